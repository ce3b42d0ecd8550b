"""Custom rewards for the user-path tests (named with --custom-rm-path, as a user would).

``record``: writes what it received — the sample's prompt text, its label and the prompt the
policy was really given (its token ids, decoded) — one JSON line per sample to the file named
by ``RELAY_TEST_RECORD``; scores 1 when the final answer equals the label.
``bad_route``: asks the judge for a GenRM instance that does not exist.
``agentic``: the documentation's agentic reward
(examples/generate_reward_model/agentic_routing.py), recording each sample's trajectory,
loss mask, log-probs and lengths to ``RELAY_TEST_RECORD``.
"""

from __future__ import annotations

import json
import os

from launcher.data import question_text
from reward.dapo_genrm import final_answer

_tokenizers: dict = {}


def record(args, sample: dict) -> dict:
    path = args.hf_checkpoint
    if path not in _tokenizers:
        from transformers import AutoTokenizer

        _tokenizers[path] = AutoTokenizer.from_pretrained(path)
    given = _tokenizers[path].decode(sample["prompt_ids"])
    with open(os.environ["RELAY_TEST_RECORD"], "a") as f:
        f.write(
            json.dumps({"question": question_text(sample["prompt"]), "label": sample["label"], "given": given}) + "\n"
        )
    ok = final_answer(sample["response"]).strip() == sample["label"]
    return {"score": float(ok), "acc": ok}


async def bad_route(args, sample: dict) -> float:
    from reward.client import get_genrm_client

    await get_genrm_client().generate([{"role": "user", "content": "hi"}], route_key="no-such-judge")
    return 0.0


async def agentic(args, sample, **kwargs) -> dict:
    from examples.generate_reward_model.agentic_routing import agentic_reward_func

    out = await agentic_reward_func(args, sample, **kwargs)
    with open(os.environ["RELAY_TEST_RECORD"], "a") as f:
        f.write(json.dumps({"modules": [s["module"] for s in sample.metadata["trajectory_steps"]],
                            "steps": sample.metadata["trajectory_steps"], "mask": sample.loss_mask,
                            "logprobs": sample.rollout_log_probs, "tokens": len(sample.tokens),
                            "prompt_tokens": len(sample.prompt_ids), "response_length": sample.response_length,
                            "response": sample.response, "status": sample.status.value,
                            "version": sample.weight_version, "score": out["score"]}) + "\n")
    return out
