"""Reward selection, custom rewards, reward keys and the concurrency bound."""

from __future__ import annotations

import asyncio

import pytest

from launcher.config import load_config
from reward.rewards import load_callable, load_post_process, make_reward_fn, reward_value

pytestmark = pytest.mark.unit
BASE = {"resource": {"actor": [1, 2], "rollout": [1, 2]}, "colocate": True}
SAMPLE = {"prompt": "2+2?", "label": "4", "response": "Answer: 4"}


def cfg(**kw):
    return load_config(None, {**BASE, **kw})


# custom rewards used by the tests (resolved as tests.reward.test_rewards.<name>)
def sync_reward(args, sample):
    return len(sample["response"])


async def async_reward(args, sample):
    await asyncio.sleep(0)
    return {"quality": 0.5, "score": 1.0}


def post_process(args, samples):
    return [1.0] * len(samples), [0.0] * len(samples)


# the original's signature, written against its Sample's attributes
async def original_style(args, sample, **kwargs) -> dict:
    from launcher.rl.sample import Sample

    done = sample.status == Sample.Status.COMPLETED
    ok = sample.response.split("Answer:")[-1].strip() == sample.metadata["label"]
    return {"score": float(ok and done), "question": sample.metadata["question"], "len": sample.response_length,
            "tokens": len(sample.tokens), "prompt": sample.prompt, "label": sample.label, "kwargs": kwargs}


def original_style_sync(args, sample, **kwargs) -> float:
    return float(sample.response_length) + (10.0 if args.reward_key == "score" else 0.0)


def post_process_running_its_own_loop(args, samples):
    """A sync hook that runs its own event loop (as the original's swap hook does): it works
    only when called outside the job's running loop."""
    async def one(s):
        await asyncio.sleep(0)
        return float(s.response_length)

    raw = [asyncio.run(one(s)) for s in samples]
    return raw, [r - sum(raw) / len(raw) for r in raw]


async def post_process_async(args, samples):
    await asyncio.sleep(0)
    return [2.0] * len(samples), [0.25] * len(samples)


def test_rule_based_dummy_and_custom():
    assert asyncio.run(make_reward_fn(cfg(rm_type="dapo"))(SAMPLE))["acc"] is True
    assert asyncio.run(make_reward_fn(cfg(rm_type="dummy"))(SAMPLE)) == 0.0
    assert asyncio.run(make_reward_fn(cfg(rm_type="dummy", reward_key="score"))(SAMPLE)) == {"score": 0.0}
    assert asyncio.run(make_reward_fn(cfg(custom_rm_path="tests.reward.test_rewards.sync_reward"))(SAMPLE)) == 9
    out = asyncio.run(make_reward_fn(cfg(custom_rm_path="tests.reward.test_rewards.async_reward"))(SAMPLE))
    assert reward_value(out, "quality") == 0.5 and reward_value(out, None) == 1.0
    with pytest.raises(KeyError, match="set --reward-key"):
        reward_value({"x": 1}, None)
    hook = load_post_process(cfg(custom_reward_post_process_path="tests.reward.test_rewards.post_process"))
    assert asyncio.run(hook(None, [1, 2])) == ([1.0, 1.0], [0.0, 0.0])  # a sync hook, awaitable like an async one


def generated(response: str, finish_reason: str = "stop"):
    from types import SimpleNamespace

    from launcher.data import Row
    from launcher.rl.sample import Sample

    result = SimpleNamespace(token_ids=[7, 8, 9], text=response, logprobs=[-0.1] * 3, finish_reason=finish_reason,
                             weight_version=0)
    return Sample.generated(Row(0, [{"role": "user", "content": "2+2?"}], "4"), "train", 0, [1, 2], result)


def test_rewards_of_the_originals_signature_get_its_sample_attributes():
    fn = make_reward_fn(cfg(custom_rm_path="tests.reward.test_rewards.original_style"))
    out = asyncio.run(fn(generated("so Answer: 4")))
    assert out == {"score": 1.0, "question": "2+2?", "len": 3, "tokens": 5,
                   "prompt": [{"role": "user", "content": "2+2?"}], "label": "4", "kwargs": {}}
    assert asyncio.run(fn(generated("so Answer: 4", finish_reason="length")))["score"] == 0.0  # TRUNCATED
    assert asyncio.run(fn(generated("so Answer: 5")))["score"] == 0.0
    sync = make_reward_fn(cfg(custom_rm_path="tests.reward.test_rewards.original_style_sync", reward_key="score"))
    assert asyncio.run(sync(generated("x"))) == 13.0


def test_post_process_hooks_sync_and_async_run_on_a_batch():
    from launcher.rl.scoring import Scorer
    from launcher.rl.timing import PhaseTimer

    for name, rewards, advs in (("post_process_running_its_own_loop", [3.0, 3.0], [0.0, 0.0]),
                                ("post_process_async", [2.0, 2.0], [0.25, 0.25])):
        c = cfg(custom_reward_post_process_path=f"tests.reward.test_rewards.{name}", n_samples_per_prompt=2)
        samples = [generated("a"), generated("b")]
        for s in samples:
            s.reward = 9.0  # scored inline before the hook (outside Defer-swap)

        scorer = Scorer(c, None, load_post_process(c), PhaseTimer())
        asyncio.run(scorer.post_process_batch(samples, 2))
        assert [s.reward for s in samples] == rewards and [s.advantage for s in samples] == advs, name


def test_genrm_reward_uses_the_judge_and_the_parse_mode():
    async def judge(messages):
        return "<think>hmm</think> 1"

    strict = asyncio.run(make_reward_fn(cfg(rm_type="dapo-genrm"), judge=judge)(SAMPLE))
    loose = asyncio.run(make_reward_fn(cfg(rm_type="dapo-genrm", genrm_parse="loose"), judge=judge)(SAMPLE))
    assert strict["score"] == 0.0 and strict["format_error"] == "parse_error"
    assert loose["score"] == 1.0

    async def judge_says(messages):
        return "Judgement: 1"

    boxed = make_reward_fn(cfg(rm_type="dapo-genrm", genrm_reward_variant="boxed"), judge=judge_says)
    assert asyncio.run(boxed({**SAMPLE, "response": "so \\boxed{4}"}))["score"] == 1.0
    assert asyncio.run(boxed({**SAMPLE, "response": "no answer"}))["format_error"] == "answer_missing"
    documented = make_reward_fn(cfg(rm_type="dapo-genrm"), judge=judge_says)
    assert asyncio.run(documented({**SAMPLE, "response": "so \\boxed{4}"}))["score"] == 0.0  # strict


def test_concurrency_is_bounded():
    active, peak = [0], [0]

    async def judge(messages):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        await asyncio.sleep(0.01)
        active[0] -= 1
        return "1"

    fn = make_reward_fn(cfg(rm_type="dapo-genrm", reward_max_concurrency=3), judge=judge)

    async def main():
        return await asyncio.gather(*(fn(SAMPLE) for _ in range(20)))

    assert all(r["score"] == 1.0 for r in asyncio.run(main()))
    assert peak[0] == 3


def test_bad_paths_and_missing_reward_say_what_to_do():
    with pytest.raises(ValueError, match="must look like"):
        load_callable("nodots", "--custom-rm-path")
    with pytest.raises(ValueError, match="cannot import module"):
        load_callable("no_such_pkg.fn", "--custom-rm-path")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_callable("tests.reward.test_rewards.nope", "--custom-rm-path")
    with pytest.raises(ValueError, match="set --rm-type"):
        make_reward_fn(cfg())
