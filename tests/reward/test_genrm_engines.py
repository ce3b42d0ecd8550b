"""``GET /genrm/engines``: each instance's engines with the place the launcher gave them
(node, GPUs, tp/dp sizes), their state (awake, asleep, failed) and their load."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from engines.actor import EngineActor
from relay import this_host
from reward.judge import start_judge_service
from tests.helpers import run
from tests.launcher.test_launch import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
MSG = [{"role": "user", "content": "Is 2+2=4? Answer 1 or 0."}]


def test_genrm_engines_lists_place_state_and_load(judge_model, faults):
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2}, name="judges")
        engines = procs.spawn("judge-engine", EngineActor, judge_model, "torch", kv_cache_tokens=2048,
                              weights_mode="backup")
        await engines.initialized(120)
        placement = [{"node": 0, "gpus": [g], "bundles": [g], "tp": 1, "dp": 1} for g in (2, 3)]
        spec = {"__default__": {"model_path": judge_model, "num_gpus": 2, "engines": [engines.slice(gpus=0),
                engines.slice(gpus=1)], "placement": placement, "sampling_config": {"max_response_len": 4}}}
        judge, judge_procs = await start_judge_service(spec, 120)
        port = await judge.serve_http.call_one("127.0.0.1", free_port(), None).result(30)
        url = f"http://127.0.0.1:{port}/genrm/engines"
        seen = []
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(url) as r:
                    seen.append((r.status, await r.json()))
                # both engines busy: each one's load shows while its requests run
                busy = [asyncio.ensure_future(s.post(f"http://127.0.0.1:{port}/genrm/generate", json={
                    "messages": MSG, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "seed": k}}))
                        for k in range(16)]
                loaded = None
                for _ in range(200):  # until both engines show work (or the requests are done)
                    async with s.get(url) as r:
                        loaded = (r.status, await r.json())
                    rows = loaded[1]["instances"]["__default__"]["engines"]
                    if all(e["in_flight"] + e["running"] > 0 for e in rows) or all(b.done() for b in busy):
                        break
                    await asyncio.sleep(0.02)
                seen.append(loaded)
                for response in await asyncio.gather(*busy):
                    response.release()
                await judge.set_awake.call_one("__default__", False).result(10)
                await engines.slice(gpus=1).sleep.call_one(["weights", "kv_cache"], "finish").result(30)
                os.kill(procs.procs[0].pid, signal.SIGKILL)
                await judge.health.call_one().result(30)  # the service notices the death
                async with s.get(url) as r:
                    seen.append((r.status, await r.json()))
        finally:
            await judge_procs.stop()
            await procs.stop()
        return seen

    (s0, idle), (s1, loaded), (s2, after) = run(main(), 240)
    assert s0 == s1 == s2 == 200
    inst = idle["instances"]["__default__"]
    assert inst["admitting"] is True and [e["state"] for e in inst["engines"]] == ["awake", "awake"]
    assert [(e["index"], e["gpus"], e["tp"], e["dp"]) for e in inst["engines"]] == [(0, [2], 1, 1), (1, [3], 1, 1)]
    assert all(e["in_flight"] == 0 and e["running"] == 0 for e in inst["engines"])
    load = loaded["instances"]["__default__"]["engines"]
    assert all(e["in_flight"] + e["running"] > 0 for e in load), load  # least-loaded dispatch spread the work
    end = after["instances"]["__default__"]
    assert end["admitting"] is False
    assert end["engines"][0]["state"] == "failed" and "its process is gone" in end["engines"][0]["error"]
    assert end["engines"][1]["state"] == "asleep"
