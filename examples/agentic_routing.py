"""An agentic reward: each step of a trajectory is judged by the judge of its module
(``route_key`` = the step's ``module``); the trajectory's score is the mean over steps.

A sample's ``trajectory`` is a list of ``{"module": "planner" | "coder" | ..., "input": str,
"output": str}``. Modules without their own judge fall back to ``default_route``.
"""

from __future__ import annotations

import asyncio

from reward.client import get_genrm_client
from reward.dapo_genrm import parse_verdict

STEP_PROMPT = "Step input:\n{input}\n\nStep output:\n{output}\n\nIs this step correct and useful? Reply 1 or 0."


async def reward_func(args, sample: dict, routes: set | None = None, default_route: str | None = None) -> dict:
    client = get_genrm_client()
    steps = sample.get("trajectory") or []
    if not steps:
        return {"score": 0.0, "steps": 0}

    async def judge(step: dict) -> int:
        route = step.get("module")
        if routes is not None and route not in routes:
            route = default_route
        reply = await client.generate([{"role": "user", "content": STEP_PROMPT.format(**step)}], route_key=route)
        return parse_verdict(reply, "loose") or 0

    verdicts = await asyncio.gather(*(judge(s) for s in steps))
    return {"score": sum(verdicts) / len(verdicts), "steps": len(steps), "verdicts": list(verdicts)}
