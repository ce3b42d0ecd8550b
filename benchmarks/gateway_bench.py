"""Judge gateway overhead: requests/s and p50/p99 latency with 64 concurrent callers,
through HTTP (aiohttp client -> gateway + judge service -> engine) and through the relay
judge client, against an engine that answers instantly, side by side with a minimal
aiohttp echo server (the floor). Prints one JSON line.

    python benchmarks/gateway_bench.py [--requests 5000] [--rounds 3] [--engine-tokenizes]

Hosting is the product's (launcher/rl/judge.py, launcher/serve_judge.py): the judge service in a
process of its own, serving the HTTP gateway there, the engine in another; the load
generator (64 callers, then 1) in the benchmark's process. Two floors: ``floor`` is the
echo server hosted like the gateway (a process of its own: benchmarks/_http_floor.py);
``floor_inproc`` serves from the load generator's process (no second process, so one
core for client and server). The floors and the gateway alternate for ``--rounds`` rounds
(the machine is shared: alternating keeps a noisy spell from landing on one side); each
figure is the median over rounds. ``http_p50_overhead_ms`` is the median over rounds of
(gateway p50 - floor p50) at 64 callers, ``*_vs_inproc_ms`` the same against the other
floor, ``http_c1_*`` the same with one caller (the latency a lone request pays). The
service renders chat templates and the engine tokenizes them; the instant engine skips
tokenizing unless ``--engine-tokenizes`` (then the same machine's cores also do that
engine work).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from engines.interface import GenerateResult, encode_rendered  # noqa: E402
from engines.models.model_builder import make_model  # noqa: E402
from relay import Actor, endpoint, this_host  # noqa: E402
from reward.client import GenRMClient  # noqa: E402
from reward.judge import freeze_startup_objects, start_judge_service  # noqa: E402

MSG = [{"role": "user", "content": "Is 2+2=4? Reply 1 or 0."}]


class InstantEngine(Actor):
    """Answers "1" at once: the benchmark measures everything but the engine's work. The
    judge service sends rendered chats, which a real engine tokenizes; with
    ``tokenize=True`` this one does that too (``--engine-tokenizes``), else it skips it."""

    def __init__(self, model_path: str = "", tokenize: bool = False):
        self.tok = None
        if tokenize:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(model_path)

    @endpoint(concurrent=True)
    async def generate_rendered(self, requests):
        n = (
            [len(ids) for ids in encode_rendered(self.tok, [t for t, _ in requests])]
            if self.tok
            else [0] * len(requests)
        )
        return [GenerateResult([16], "1", [-0.1], "stop", k, 0) for k in n]

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

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency // 8))))  # warm-up
    lat.clear()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    el = time.perf_counter() - t0
    lat.sort()
    return {
        "req_s": round(len(lat) / el),
        "p50_ms": round(statistics.median(lat) * 1e3, 2),
        "p99_ms": round(lat[max(0, int(len(lat) * 0.99) - 1)] * 1e3, 2),
    }


async def http_load(port: int, n: int, concurrency: int, check: bool) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:

        async def call():
            async with s.post(f"http://127.0.0.1:{port}/genrm/generate", json={"messages": MSG}) as r:
                if check:
                    assert r.status == 200
                await r.json()

        return await load(call, n, concurrency)


def _median_of(rounds: list[dict], prefix: str) -> dict:
    return {f"{prefix}_{k}": statistics.median(r[k] for r in rounds) for k in rounds[0]}


async def main(n: int, rounds: int, engine_tokenizes: bool) -> dict:
    out = {
        "bench": "gateway",
        "requests": n,
        "rounds": rounds,
        "concurrency": 64,
        "cpus": os.cpu_count(),
        "engine_tokenizes": engine_tokenizes,
    }
    tok_dir = make_model("qwen3", "tiny", tempfile.mkdtemp(prefix="gw-bench-"), seed=0)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    engine = procs.spawn("engine", InstantEngine, tok_dir, engine_tokenizes)
    await engine.initialized(60)
    spec = {"__default__": {"model_path": tok_dir, "sampling_config": {"temperature": 0.5}, "engines": [engine]}}
    judge, judge_procs = await start_judge_service(spec, 120, cache="off")
    port = await judge.serve_http.call_one("127.0.0.1", 0).result(60)

    # floor hosted like the gateway: a minimal aiohttp echo in a process of its own
    fport = free_port()
    floor = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_http_floor.py"), str(fport)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert floor.stdout.readline().strip() == "ready", "the floor server did not start"

        # floor in the load generator's process
        async def echo(request):
            await request.json()
            return web.json_response({"response": "1"})

        app = web.Application()
        app.router.add_post("/genrm/generate", echo)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        iport = free_port()
        await web.TCPSite(runner, "127.0.0.1", iport).start()

        freeze_startup_objects()  # the load generator's process imported torch: no full GCs over it
        n1 = max(100, n // 10)
        sides = {"floor": fport, "http": port, "floor_inproc": iport}
        res: dict[str, list] = {k + c: [] for k in sides for c in ("", "_c1")}
        for _ in range(rounds):
            for k, p in sides.items():
                res[k].append(await http_load(p, n, 64, k == "http"))
            for k, p in sides.items():
                res[k + "_c1"].append(await http_load(p, n1, 1, k == "http"))
        for k, v in res.items():
            out.update(_median_of(v, k))
        for c in ("", "_c1"):
            for floor_key, suffix in (("floor", ""), ("floor_inproc", "_vs_inproc")):
                diffs = [h["p50_ms"] - f["p50_ms"] for h, f in zip(res["http" + c], res[floor_key + c])]
                out[f"http{c}_p50_overhead{suffix}_ms"] = round(statistics.median(diffs), 2)
        await runner.cleanup()
    finally:
        floor.kill()
        floor.wait()
    client = GenRMClient(judge_procs.procs[0].addr)

    async def zmq_call():
        assert await client.generate(MSG) == "1"

    out.update(_median_of([await load(zmq_call, n) for _ in range(rounds)], "zmq"))
    await judge_procs.stop()
    await procs.stop()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--engine-tokenizes",
        action="store_true",
        help="the instant engine tokenizes the rendered chats, as a real one does",
    )
    a = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(main(a.requests, a.rounds, a.engine_tokenizes))))
