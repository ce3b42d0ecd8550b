"""``relay demo --runtime``: a tour of the runtime the stack is built on: a process mesh
on this host, real replies, a real failure surfaced as a SupervisionError, a clean stop."""

from __future__ import annotations

import asyncio
import os
import time

from relay import (
    Actor,
    ActorError,
    SupervisionError,
    context,
    endpoint,
    set_unhandled_fault_hook,
    this_host,
)


class Greeter(Actor):
    @endpoint
    async def hello(self, who: str) -> str:
        ctx = context()
        return f"hello {who} from rank {ctx.rank} {ctx.coords} (pid {os.getpid()})"

    @endpoint
    async def fail(self) -> None:
        raise ValueError("an endpoint error reaches the caller; the actor lives on")

    @endpoint
    async def crash(self) -> None:
        os._exit(3)


async def _demo(procs: int) -> int:
    failures = []
    set_unhandled_fault_hook(failures.append)  # the demo reports the failure itself
    t0 = time.perf_counter()
    mesh = this_host().spawn_procs(per_host={"gpus": procs}, name="demo")
    greeters = mesh.spawn("greeter", Greeter)
    replies = await greeters.hello.call("relay")
    print(f"spawned {procs} processes and got {len(replies)} replies in {time.perf_counter() - t0:.2f} s:")
    for point, text in replies.items():
        print(f"  {point.coords}: {text}")
    try:
        await greeters.slice(gpus=0).fail.call_one()
    except ActorError as e:
        print(f"ActorError from rank {e.rank}: {e.exception}")
    try:
        await greeters.slice(gpus=procs - 1).crash.call_one().result(timeout=30)
    except SupervisionError as e:
        print(f"SupervisionError: {e.failure}")
    print(f"the others still answer: {len(await greeters.slice(gpus=slice(0, procs - 1)).hello.call('again'))} replies")
    await mesh.stop()
    print("stopped cleanly")
    return 0 if len(failures) == 1 else 1


def run_relay_demo(procs: int = 4) -> int:
    if procs < 2:
        raise SystemExit("relay demo --runtime: --procs must be at least 2")
    from launcher.job import install_uvloop

    install_uvloop()
    return asyncio.run(_demo(procs))
