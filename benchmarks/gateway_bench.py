"""Judge gateway overhead: requests/s and p50/p99 latency with 64 concurrent callers,
through HTTP (aiohttp client -> gateway -> judge service -> engine) and through the relay
judge client, against an engine that answers instantly, side by side with a minimal
aiohttp echo server (the floor). Prints one JSON line.

    python benchmarks/gateway_bench.py [--requests 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from engines.interface import GenerateResult  # noqa: E402
from engines.model_builder import make_model  # noqa: E402
from relay import Actor, endpoint, this_host, this_proc  # noqa: E402
from reward.client import GenRMClient  # noqa: E402
from reward.gateway import serve  # noqa: E402
from reward.judge import JudgeService  # noqa: E402

MSG = [{"role": "user", "content": "Is 2+2=4? Reply 1 or 0."}]


class InstantEngine(Actor):
    """Answers "1" at once: the benchmark measures everything but the model."""

    @endpoint(concurrent=True)
    async def generate(self, prompt, sampling=None, chat_template_kwargs=None):
        return GenerateResult([16], "1", [-0.1], "stop", len(prompt), 0)

    @endpoint(concurrent=True)
    async def health(self):
        return {"status": "healthy"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def load(call, n: int, concurrency: int = 64) -> dict:
    lat: list[float] = []
    per = n // concurrency

    async def worker():
        for _ in range(per):
            t = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t)

    await asyncio.gather(*(worker() for _ in range(concurrency // 8)))  # warm-up
    lat.clear()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    el = time.perf_counter() - t0
    lat.sort()
    return {"req_s": round(len(lat) / el), "p50_ms": round(statistics.median(lat) * 1e3, 2), "p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1e3, 2)}


async def main(n: int) -> dict:
    out = {"bench": "gateway", "requests": n, "concurrency": 64, "cpus": os.cpu_count()}
    # floor: a minimal aiohttp server answering {"response": "1"}
    async def echo(request):
        await request.json()
        return web.json_response({"response": "1"})

    app = web.Application()
    app.router.add_post("/genrm/generate", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    fport = free_port()
    await web.TCPSite(runner, "127.0.0.1", fport).start()
    conn = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def floor_call():
            async with s.post(f"http://127.0.0.1:{fport}/genrm/generate", json={"messages": MSG}) as r:
                await r.json()

        out.update({f"floor_{k}": v for k, v in (await load(floor_call, n)).items()})
    await runner.cleanup()

    # the judge stack: engine process <- judge service (here) <- gateway (here)
    tok_dir = make_model("qwen3", "tiny", tempfile.mkdtemp(prefix="gw-bench-"), seed=0)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    engine = procs.spawn("engine", InstantEngine)
    await engine.initialized(60)
    judge = this_proc().spawn("genrm", JudgeService, {"__default__": {"model_path": tok_dir, "sampling_config": {"temperature": 0.5}, "engines": [engine]}}, cache="off")
    await judge.initialized(120)
    port = free_port()
    grunner = await serve(judge, "127.0.0.1", port)
    conn = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def http_call():
            async with s.post(f"http://127.0.0.1:{port}/genrm/generate", json={"messages": MSG}) as r:
                assert r.status == 200
                await r.json()

        out.update({f"http_{k}": v for k, v in (await load(http_call, n)).items()})
    await grunner.cleanup()
    client = GenRMClient(judge._view.members[0].proc.addr)

    async def zmq_call():
        assert await client.generate(MSG) == "1"

    out.update({f"zmq_{k}": v for k, v in (await load(zmq_call, n)).items()})
    out["http_p50_overhead_ms"] = round(out["http_p50_ms"] - out["floor_p50_ms"], 2)
    await procs.stop()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    a = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(main(a.requests))))
