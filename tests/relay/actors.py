"""Actor classes used by the relay tests (importable by worker processes)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import time
from dataclasses import dataclass

import relay
from relay import Actor, context, endpoint


@relay.register
@dataclass
class Job:
    name: str
    weights: list
    meta: dict


class Echo(Actor):
    @endpoint
    async def echo(self, x):
        return x

    @endpoint
    async def whoami(self):
        ctx = context()
        return {
            "rank": ctx.rank,
            "coords": ctx.coords,
            "extent": ctx.extent,
            "message_rank": ctx.message_rank,
            "pid": os.getpid(),
        }

    @endpoint
    async def sleep_then(self, seconds: float, value):
        await asyncio.sleep(seconds)
        return value

    @endpoint
    async def sleep_by_rank(self, base: float):
        ctx = context()
        n = ctx.extent["gpus"]
        await asyncio.sleep((n - 1 - ctx.rank) * base)
        return ctx.rank

    @endpoint
    async def stats(self):
        return relay.transport_stats()

    @endpoint
    async def env(self, name: str):
        return os.environ.get(name)

    @endpoint
    async def unregistered_reply(self):
        return object()


class Counter(Actor):
    def __init__(self, start: int = 0):
        self.n = start
        self.log: list = []

    @endpoint
    async def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    async def record(self, item) -> None:
        self.log.append(item)

    @endpoint
    async def get_log(self) -> list:
        return self.log

    @endpoint
    async def value(self) -> int:
        return self.n


class SyncCounter(Actor):
    """All-sync actor: endpoints run on the actor's own thread."""

    def __init__(self):
        self.n = 0

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @endpoint
    def call_other(self, other: relay.ActorMesh, x):
        # A sync endpoint may block on other actors with .get()
        return other.echo.call_one(x).get(timeout=30)


class Overlap(Actor):
    """Measures how many handlers run at once."""

    def __init__(self):
        self.active = 0
        self.peak = 0

    async def _work(self, seconds):
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(seconds)
        self.active -= 1
        return self.peak

    @endpoint
    async def serial(self, seconds: float):
        return await self._work(seconds)

    @endpoint(concurrent=True)
    async def parallel(self, seconds: float):
        return await self._work(seconds)

    @endpoint
    async def peak_seen(self):
        return self.peak

    @endpoint
    async def reenter(self):
        # Serial endpoint calling itself through its own mesh: rejected, not deadlocked.
        me = self.mesh
        return await me.peak_seen.call_one()

    @endpoint
    async def set_mesh(self, mesh):
        self.mesh = mesh


class Faulty(Actor):
    @endpoint
    async def ok(self):
        return "ok"

    @endpoint
    async def boom(self, message: str):
        raise ValueError(message)

    @endpoint
    async def exit_with(self, code: int):
        os._exit(code)

    @endpoint
    async def kill_self(self, sig: int):
        os.kill(os.getpid(), sig)
        await asyncio.sleep(30)

    @endpoint
    async def segfault(self):
        ctypes.string_at(0)

    @endpoint(concurrent=True)
    async def hang(self, seconds: float):
        await asyncio.sleep(seconds)
        return "woke"

    @endpoint
    async def pid(self):
        return os.getpid()


class BadInit(Actor):
    def __init__(self):
        raise RuntimeError("init exploded")

    @endpoint
    async def ok(self):
        return "ok"


class Supervisor(Actor):
    """Owns a child mesh; records failures; handles them or not."""

    def __init__(self, handle: bool):
        self.handle = handle
        self.failures: list = []

    @endpoint
    async def start_children(self, n: int):
        self.procs = relay.this_host().spawn_procs(per_host={"gpus": n}, name="children")
        self.children = self.procs.spawn("kids", Faulty)
        await self.children.initialized()
        return await self.children.pid.call()

    @endpoint
    async def kill_child(self, rank: int):
        pids = (await self.children.pid.call()).values()
        os.kill(pids[rank], signal.SIGKILL)

    @endpoint
    async def call_children(self):
        try:
            return (await self.children.ok.call().result(10)).values()
        except relay.SupervisionError as e:
            return f"SupervisionError: {e}"

    @endpoint
    async def broadcast_boom(self):
        self.children.boom.broadcast("from broadcast")

    @endpoint
    async def seen(self):
        return [str(f) for f in self.failures]

    @endpoint
    async def seen_kinds(self):
        return [f.kind for f in self.failures]

    def __supervise__(self, failure):
        self.failures.append(failure)
        return self.handle


class Cleanup(Actor):
    def __init__(self, path: str):
        self.path = path

    @endpoint
    async def ping(self):
        return "pong"

    async def __cleanup__(self, exc):
        with open(self.path, "w") as f:
            f.write("cleaned")


class Spawner(Actor):
    """Spawns grandchildren, to check that they die with their parent."""

    @endpoint
    async def spawn_grandchildren(self, n: int):
        self.procs = relay.this_host().spawn_procs(per_host={"gpus": n}, name="grandchildren")
        kids = self.procs.spawn("kids", Faulty)
        return (await kids.pid.call()).values()

    @endpoint
    async def pid(self):
        return os.getpid()


class TorchDist(Actor):
    @endpoint
    def all_reduce(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://", timeout=__import__("datetime").timedelta(seconds=60))
        t = torch.tensor([value])
        dist.all_reduce(t)
        out = float(t.item())
        dist.destroy_process_group()
        return out


class Caller(Actor):
    """Calls another process's actor (a mesh it was given, not one it owns)."""

    def __init__(self, target):
        self.target = target

    @endpoint(concurrent=True)
    async def call(self, method: str, *args) -> list:
        """[outcome, detail, seconds]: "ok" and the result, or the error's type and text."""
        t0 = time.monotonic()
        try:
            return ["ok", await getattr(self.target, method).call_one(*args).result(60), time.monotonic() - t0]
        except Exception as e:  # noqa: BLE001 - reported to the test
            return [type(e).__name__, str(e), time.monotonic() - t0]


class Probe(Actor):
    """What a worker process looks like from inside (fork-server tests)."""

    @endpoint
    async def info(self, modules: list, var: str) -> dict:
        import ctypes
        import sys

        getenv = ctypes.CDLL(None).getenv
        getenv.restype = ctypes.c_char_p
        return {"pid": os.getpid(), "ppid": os.getppid(), "modules": [m in sys.modules for m in modules],
                "var": os.environ.get(var), "cwd": os.getcwd(), "libc_var": (getenv(var.encode()) or b"").decode(),
                "environ": dict(os.environ)}
