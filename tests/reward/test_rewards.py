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
    assert hook(None, [1, 2]) == ([1.0, 1.0], [0.0, 0.0])


def test_genrm_reward_uses_the_judge_and_the_parse_mode():
    async def judge(messages):
        return "<think>hmm</think> 1"

    strict = asyncio.run(make_reward_fn(cfg(rm_type="dapo-genrm"), judge=judge)(SAMPLE))
    loose = asyncio.run(make_reward_fn(cfg(rm_type="dapo-genrm", genrm_parse="loose"), judge=judge)(SAMPLE))
    assert strict["score"] == 0.0 and strict["format_error"] == "parse_error"
    assert loose["score"] == 1.0


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
