"""Per-sender FIFO, one message at a time per actor, opt-in concurrency, spawn-time checks."""

from __future__ import annotations

import asyncio

import pytest

from relay import Actor, ActorError, endpoint, this_host
from tests.helpers import run
from tests.relay.actors import Counter, Echo, Overlap, SyncCounter

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_per_sender_fifo_across_adverbs():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        mesh = procs.spawn("counter", Counter)
        futs = []
        for i in range(300):
            if i % 3 == 0:
                mesh.record.broadcast(i)
            else:
                futs.append(mesh.record.call_one(i))
        await asyncio.gather(*(f.result() for f in futs))
        assert await mesh.get_log.call_one() == list(range(300))
        await procs.stop()

    run(main())


def test_init_runs_before_first_message():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        # Calls issued before the processes even started are queued behind the spawn.
        mesh = procs.spawn("counter", Counter, 41)
        assert (await mesh.incr.call()).values() == [42, 42]
        await procs.stop()

    run(main())


def test_serial_endpoints_never_overlap():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        mesh = procs.spawn("overlap", Overlap)
        peaks = await asyncio.gather(*(mesh.serial.call_one(0.05).result() for _ in range(6)))
        assert max(peaks) == 1
        await procs.stop()

    run(main())


def test_concurrent_endpoints_overlap_when_opted_in():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        mesh = procs.spawn("overlap", Overlap)
        await asyncio.gather(*(mesh.parallel.call_one(0.3).result() for _ in range(4)))
        assert await mesh.peak_seen.call_one() == 4
        await procs.stop()

    run(main())


def test_sync_actor_runs_on_its_thread_and_can_block_on_others():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        counter = procs.spawn("sync", SyncCounter)
        echo = procs.spawn("echo", Echo)
        assert (await counter.incr.call(2)).values() == [2, 2]
        # A long sync endpoint does not block the process's event loop: echo still answers.
        slow = counter.slow.call(1.0)
        assert await echo.slice(gpus=0).echo.call_one("fast") == "fast"
        assert not slow.done()
        assert (await slow).values() == ["done", "done"]
        # Sync endpoints can call other actors with .get()
        assert await counter.slice(gpus=0).call_other.call_one(echo.slice(gpus=1), {"k": [1, 2]}) == {"k": [1, 2]}
        await procs.stop()

    run(main())


class Mixed(Actor):
    @endpoint
    def a(self):
        return 1

    @endpoint
    async def b(self):
        return 2


def test_mixing_sync_and_async_endpoints_is_rejected_at_spawn():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        with pytest.raises(ValueError, match="mixes both async and sync endpoints"):
            procs.spawn("mixed", Mixed)
        await procs.stop()

    run(main())


def test_concurrent_sync_endpoint_is_rejected_at_definition():
    with pytest.raises(TypeError, match="concurrent=True needs an async method"):

        class Bad(Actor):
            @endpoint(concurrent=True)
            def f(self):
                return 1


def test_self_call_through_own_mesh_is_rejected_not_deadlocked():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        mesh = procs.spawn("overlap", Overlap)
        with pytest.raises(RuntimeError, match="still being spawned"):
            mesh.set_mesh.call_one(mesh)  # refused at the sender: it could overtake the spawn
        await mesh.initialized()
        await mesh.set_mesh.call_one(mesh)
        with pytest.raises(ActorError, match="would deadlock"):
            await mesh.reenter.call_one().result(timeout=10)
        await procs.stop()

    run(main())


def test_duplicate_actor_names_are_rejected():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        procs.spawn("x", Echo)
        with pytest.raises(ValueError, match="already exists"):
            procs.spawn("x", Counter)
        await procs.stop()

    run(main())
