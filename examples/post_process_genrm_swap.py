"""The defer-swap hook named by the ``*-defer`` configs
(``--custom-reward-post-process-path examples.post_process_genrm_swap.custom_reward_post_process``).

Called with ``(args, samples)`` after rollout, when the judge is awake and rollout asleep;
scores every sample with the judge and returns ``(raw, normalized)``: raw rewards and
GRPO group-normalized ones (mean, divided by std + 1e-6; groups of n_samples_per_prompt).
The sleep/wake around it is the controller's job (issue #7).
"""

from __future__ import annotations

import asyncio
import statistics

from reward.client import get_genrm_client
from reward.dapo_genrm import score


async def custom_reward_post_process(args, samples: list[dict]):
    judge = get_genrm_client().generate
    results = await asyncio.gather(
        *(
            score(
                s,
                judge,
                parse=getattr(args, "genrm_parse", "strict"),
                template=getattr(args, "genrm_prompt_template", None),
            )
            for s in samples
        )
    )
    raw = [r["score"] for r in results]
    n = max(1, getattr(args, "n_samples_per_prompt", 1))
    if len(raw) % n:
        raise ValueError(f"{len(raw)} samples do not make whole groups of {n}")
    normalized = []
    for g in range(0, len(raw), n):
        group = raw[g : g + n]
        mean = statistics.fmean(group)
        std = statistics.pstdev(group) if len(group) > 1 else 0.0
        normalized += [(x - mean) / (std + 1e-6) for x in group]
    for s, r in zip(samples, results):
        s["reward_info"] = r
    return raw, normalized
