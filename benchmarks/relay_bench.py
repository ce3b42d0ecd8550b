"""relay vs a raw pyzmq+msgpack DEALER/ROUTER floor, measured side by side in one run.

Prints one JSON line. Keys for relay, and the same keys prefixed ``floor_`` for the floor:
rtt_us_p50_8b, rtt_us_p50_1kib, rtt_us_p50_1mib (serial echo), calls_per_s_pipelined (64
outstanding 1 KiB calls), fanout8_us_p50 (one 1 KiB call to 8 actors, gather 8 replies),
bulk_mb_per_s (64 MiB array, small ack back), startup_s (spawn 4 processes until all reply).

Both sides use the same machinery a real client would: uvloop, ipc:// sockets, and (for the
floor) zmq.asyncio on the client and a bare blocking ROUTER loop in each server process.
Usage: python benchmarks/relay_bench.py [--quick]
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq
import zmq.asyncio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from relay import Actor, endpoint, this_host  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


class BenchEcho(Actor):
    @endpoint
    async def echo(self, x):
        return x

    @endpoint
    async def size(self, arr) -> int:
        return arr.nbytes


def p50_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


async def measure(call_one, call_all, bulk, n_rtt: int, n_pipe: int, n_fan: int, n_bulk: int) -> dict:
    """The same measurements for relay and for the floor: ``call_one(payload)`` echoes on one
    actor, ``call_all(payload)`` on all 8, ``bulk(array)`` returns the byte count."""
    out = {}
    for label, size in (("8b", 8), ("1kib", 1024), ("1mib", 1 << 20)):
        payload = b"x" * size
        n = n_rtt if size < (1 << 20) else max(50, n_rtt // 20)
        for _ in range(20):
            await call_one(payload)
        samples = []
        for _ in range(n):
            t = time.perf_counter()
            await call_one(payload)
            samples.append(time.perf_counter() - t)
        out[f"rtt_us_p50_{label}"] = p50_us(samples)

    payload = b"x" * 1024
    per_worker = n_pipe // 64

    async def worker():
        for _ in range(per_worker):
            await call_one(payload)

    await asyncio.gather(*(worker() for _ in range(64)))
    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(64)))
    out["calls_per_s_pipelined"] = round(64 * per_worker / (time.perf_counter() - t))

    samples = []
    for i in range(n_fan + 20):
        t = time.perf_counter()
        await call_all(payload)
        if i >= 20:
            samples.append(time.perf_counter() - t)
    out["fanout8_us_p50"] = p50_us(samples)

    arr = np.random.default_rng(0).integers(0, 255, size=64 << 20, dtype=np.uint8)
    await bulk(arr)
    t = time.perf_counter()
    for _ in range(n_bulk):
        assert await bulk(arr) == arr.nbytes
    out["bulk_mb_per_s"] = round(n_bulk * arr.nbytes / (1 << 20) / (time.perf_counter() - t))
    return out


# ---------------------------------------------------------------------------- relay side


async def bench_relay(n_rtt: int, n_pipe: int, n_fan: int, n_bulk: int) -> dict:
    out = {}
    t0 = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"gpus": 4}, name="startup")
    mesh = procs.spawn("echo", BenchEcho)
    await mesh.echo.call(0)
    out["startup_s"] = round(time.perf_counter() - t0, 3)
    await procs.stop()

    procs = this_host().spawn_procs(per_host={"gpus": 8})
    mesh = procs.spawn("echo", BenchEcho)
    await mesh.echo.call(0)
    one = mesh.slice(gpus=0)
    out.update(
        await measure(
            lambda p: one.echo.call_one(p).result(),
            lambda p: mesh.echo.call(p).result(),
            lambda a: one.size.call_one(a).result(),
            n_rtt,
            n_pipe,
            n_fan,
            n_bulk,
        )
    )
    await procs.stop()
    return out


# ---------------------------------------------------------------------------- floor side


class FloorClient:
    def __init__(self, ctx: zmq.asyncio.Context, addr: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(addr)
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self):
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            rid, payload = msgpack.unpackb(frames[0].buffer)
            fut = self.pending.pop(rid, None)
            if fut is not None:
                fut.set_result(payload)

    async def call(self, payload):
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        await self.sock.send_multipart([msgpack.packb([rid, payload])])
        return await fut

    async def bulk(self, arr):
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        await self.sock.send_multipart([msgpack.packb([rid, None]), arr], copy=False)
        return await fut

    async def close(self):
        self.reader.cancel()
        self.sock.send_multipart([msgpack.packb([0, "stop"])])
        await asyncio.sleep(0.05)
        self.sock.close(0)


def start_servers(n: int, tmp: str) -> tuple[list[subprocess.Popen], list[str]]:
    addrs = [f"ipc://{tmp}/floor{i}" for i in range(n)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_floor_server.py"), a]) for a in addrs]
    return procs, addrs


async def bench_floor(n_rtt: int, n_pipe: int, n_fan: int, n_bulk: int) -> dict:
    out = {}
    ctx = zmq.asyncio.Context()
    tmp = tempfile.mkdtemp(prefix="floor-")
    t0 = time.perf_counter()
    servers, addrs = start_servers(4, tmp)
    clients = [FloorClient(ctx, a) for a in addrs]
    await asyncio.gather(*(c.call(0) for c in clients))
    out["startup_s"] = round(time.perf_counter() - t0, 3)
    for c in clients:
        await c.close()
    for s in servers:
        s.wait(10)

    servers, addrs = start_servers(8, tmp)
    clients = [FloorClient(ctx, a) for a in addrs]
    await asyncio.gather(*(c.call(0) for c in clients))
    one = clients[0]

    async def call_all(payload):
        return await asyncio.gather(*(c.call(payload) for c in clients))

    out.update(await measure(one.call, call_all, one.bulk, n_rtt, n_pipe, n_fan, n_bulk))
    for c in clients:
        await c.close()
    for s in servers:
        s.wait(10)
    ctx.term()
    return {f"floor_{k}": v for k, v in out.items()}


def main() -> None:
    quick = "--quick" in sys.argv
    n = dict(
        n_rtt=300 if quick else 2000,
        n_pipe=6400 if quick else 32000,
        n_fan=100 if quick else 500,
        n_bulk=5 if quick else 20,
    )
    try:
        import uvloop

        uvloop.install()
        loop_name = "uvloop"
    except ImportError:
        loop_name = "asyncio"
    # Interleave: floor, relay, floor, relay; report the median of each key over both rounds.
    rounds: list[tuple[dict, dict]] = []
    for _ in range(1 if quick else 2):
        f = asyncio.run(bench_floor(**n))
        r = asyncio.run(bench_relay(**n))
        rounds.append((f, r))
    result = {"bench": "relay", "loop": loop_name, "cpus": os.cpu_count(), "python": platform.python_version()}
    for key in rounds[0][1]:
        result[key] = statistics.median(r[key] for _, r in rounds)
    for key in rounds[0][0]:
        result[key] = statistics.median(f[key] for f, _ in rounds)
    for key in ("rtt_us_p50_8b", "rtt_us_p50_1kib", "rtt_us_p50_1mib", "fanout8_us_p50"):
        result[f"ratio_{key}"] = round(result[key] / result[f"floor_{key}"], 2)
    for key in ("calls_per_s_pipelined", "bulk_mb_per_s"):
        result[f"ratio_{key}"] = round(result[key] / result[f"floor_{key}"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
