"""An agentic rollout in slime's custom-generate contract, the kind the documentation's
agentic reward (agentic_routing.py) presupposes: a plan turn, a calculator call whose output
the policy did not write (``loss_mask`` 0, log-prob 0), a final-answer turn. Each step goes
into ``sample.metadata["trajectory_steps"]`` as ``{"module", "input", "output"}``.

    relay train ... \\
      --custom-generate-function-path examples.generate_reward_model.agentic_rollout.generate \\
      --custom-rm-path examples.generate_reward_model.agentic_routing.agentic_reward_func \\
      --genrm-instances '{"planner_judge": {...}, "tool_call_judge": {...}, "final_answer_judge": {...}}'

It generates through ``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate``
(SGLang's API: the rollout engines here, SGLang's router in the original), so the same file
runs on both.
"""

from __future__ import annotations

import re

import aiohttp

_NUMBERS = re.compile(r"-?\d+(?:\.\d+)?")
_TOKENIZERS: dict = {}


def _tokenizer(args):
    if args.hf_checkpoint not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[args.hf_checkpoint] = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    return _TOKENIZERS[args.hf_checkpoint]


async def _post(session, args, payload: dict) -> dict:
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    async with session.post(url, json=payload) as response:
        response.raise_for_status()
        return await response.json()


def calculator(text: str) -> str:
    """The tool: the sum of the numbers the plan wrote (a stand-in for any tool call)."""
    numbers = [float(n) for n in _NUMBERS.findall(text)]
    return f"{sum(numbers):g}" if numbers else "no numbers"


async def generate(args, sample, sampling_params):
    # one session for the rollout's turns; a turn that hangs fails after 10 minutes
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await _rollout(session, args, sample, sampling_params)


async def _rollout(session, args, sample, sampling_params):
    tok = _tokenizer(args)
    budget = sampling_params["max_new_tokens"]
    response_ids: list[int] = []
    loss_mask: list[int] = []
    log_probs: list[float] = []
    text, steps, output = "", [], None

    async def turn(module: str, max_new_tokens: int) -> dict:
        nonlocal text
        out = await _post(session, args, {"input_ids": sample.tokens + response_ids, "return_logprob": True,
                                 "sampling_params": {**sampling_params, "max_new_tokens": max_new_tokens}})
        pairs = out["meta_info"]["output_token_logprobs"]
        response_ids.extend(t for _, t, _ in pairs)
        log_probs.extend(lp for lp, _, _ in pairs)
        loss_mask.extend([1] * len(pairs))
        steps.append({"module": module, "input": sample.prompt + text, "output": out["text"]})
        text += out["text"]
        return out

    output = await turn("plan", max(1, budget // 2))
    if output["meta_info"]["finish_reason"]["type"] != "abort":
        observation = f"\nObservation: {calculator(output['text'])}\n"
        ids = tok(observation, add_special_tokens=False)["input_ids"][: budget - len(response_ids)]  # the budget
        observation = tok.decode(ids)
        response_ids.extend(ids)
        loss_mask.extend([0] * len(ids))
        log_probs.extend([0.0] * len(ids))
        steps.append({"module": "tool_call", "input": output["text"], "output": observation})
        text += observation
        left = budget - len(response_ids)
        if left > 0:
            output = await turn("final_answer", left)

    sample.tokens = sample.tokens + response_ids
    sample.response_length = len(response_ids)
    sample.response = text
    sample.loss_mask = loss_mask
    sample.rollout_log_probs = log_probs
    sample.metadata["trajectory_steps"] = steps
    finish = output["meta_info"]["finish_reason"]["type"]
    if finish == "abort":
        sample.status = sample.Status.ABORTED
    elif finish == "length" or len(response_ids) >= budget:
        sample.status = sample.Status.TRUNCATED
    else:
        sample.status = sample.Status.COMPLETED
    return sample
