"""The defer-swap hook of the original's ``examples/generate_reward_model/post_process_genrm_swap.py``
(``--custom-reward-post-process-path
examples.generate_reward_model.post_process_genrm_swap.custom_reward_post_process``, with
``--rm-type dummy --defer-reward-to-post-process``; torchrun_configs/*-defer.yaml).

The contract (the original's ``post_process_rewards``): ``custom_reward_post_process(args,
samples) -> (raw_rewards, normalized_rewards)``, one of each per sample, samples in group
order (``args.n_samples_per_prompt`` per group). This hook scores every sample with the
dapo-genrm judge concurrently (a failed judge call scores 0), writes each sample's
``reward`` and ``reward_info``, and applies GRPO's group normalization itself (reward minus
the group's mean, divided by its std + 1e-6).

What the original's hook also does itself, the loop does here (launcher/rl/loop.py,
``_judge_window``): rollout sleeps and the judge wakes before the hook is called, and the
judge sleeps again in a ``finally`` whatever the hook did. A hook may be sync or async.
"""

from __future__ import annotations

import asyncio
import statistics

from reward.client import get_genrm_client
from reward.dapo_genrm import score


async def custom_reward_post_process(args, samples):
    judge = get_genrm_client().generate
    results = await asyncio.gather(
        *(
            score(
                s,
                judge,
                parse=getattr(args, "genrm_parse", "strict"),
                template=getattr(args, "genrm_prompt_template", None),
                variant=getattr(args, "genrm_reward_variant", "documented"),
                guard=getattr(args, "genrm_answer_guard", True),
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
    for s, r, x in zip(samples, results, raw):
        s["reward_info"] = r
        s["reward"] = x
    return raw, normalized
