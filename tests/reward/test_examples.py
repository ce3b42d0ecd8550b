"""The examples against a real judge service with two instances (tiny built-in engines)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from examples import agentic_routing, post_process_genrm_swap, reward_dual_genrm_quality_safety
from tests.helpers import run
from tests.reward.test_judge_gateway import start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_examples_call_the_judges_through_route_keys(judge_model, monkeypatch):
    async def main():
        procs, engines, judge, judge_procs, url = await start(judge_model, instances=("quality", "safety"))
        monkeypatch.setenv("RELAY_GENRM_ADDR", judge._view.members[0].proc.addr)
        sample = {"prompt": "2+2?", "label": "4", "response": "Answer: 4"}
        dual = await reward_dual_genrm_quality_safety.reward_func(None, sample)
        agent = await agentic_routing.reward_func(
            None,
            {
                "trajectory": [
                    {"module": "quality", "input": "a", "output": "b"},
                    {"module": "planner", "input": "c", "output": "d"},
                ]
            },
            routes={"quality", "safety"},
            default_route="safety",
        )
        args = SimpleNamespace(n_samples_per_prompt=2, genrm_parse="loose")
        raw, norm = await post_process_genrm_swap.custom_reward_post_process(args, [dict(sample), dict(sample)])
        snap = await judge.metrics_snapshot.call_one()
        await judge_procs.stop()
        await procs.stop()
        return dual, agent, raw, norm, snap

    dual, agent, raw, norm, snap = run(main(), 240)
    assert set(dual) == {"score", "quality", "safety"} and dual["score"] == dual["quality"] * dual["safety"]
    assert agent["steps"] == 2 and len(agent["verdicts"]) == 2
    assert len(raw) == 2 and len(norm) == 2 and abs(sum(norm)) < 1e-6
    # both judges were really called (requests counted per instance by the service)
    assert snap["quality"]["requests"] >= 2 and snap["safety"]["requests"] >= 2
    assert "RELAY_GENRM_ADDR" in os.environ
