"""Adverbs (call, call_one, choose, stream, broadcast), slicing, context and ValueMesh."""

from __future__ import annotations

import pytest

from relay import CallTimeout, ValueMesh, this_host
from tests.helpers import run
from tests.relay.actors import Counter, Echo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_call_returns_value_mesh_in_rank_order():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 3})
        mesh = procs.spawn("echo", Echo)
        vm = await mesh.whoami.call()
        assert isinstance(vm, ValueMesh)
        assert vm.extent == {"hosts": 1, "gpus": 3}
        assert [v["rank"] for v in vm.values()] == [0, 1, 2]
        assert [p.coords for p, _ in vm.items()] == [{"hosts": 0, "gpus": i} for i in range(3)]
        assert vm.item(hosts=0, gpus=2)["coords"] == {"hosts": 0, "gpus": 2}
        assert len({v["pid"] for v in vm.values()}) == 3  # real, distinct processes
        await procs.stop()

    run(main())


def test_call_one_needs_exactly_one_actor():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("echo", Echo)
        with pytest.raises(ValueError, match="exactly one actor"):
            mesh.echo.call_one(1)
        assert await mesh.slice(gpus=1).echo.call_one("x") == "x"
        await procs.stop()

    run(main())


def test_choose_picks_a_random_single_actor():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 4})
        mesh = procs.spawn("echo", Echo)
        ranks = {(await mesh.whoami.choose())["rank"] for _ in range(60)}
        assert ranks <= {0, 1, 2, 3} and len(ranks) >= 2
        await procs.stop()

    run(main())


def test_stream_yields_in_arrival_order():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 3})
        mesh = procs.spawn("echo", Echo)
        # Rank r sleeps (2 - r) * 0.4 s, so replies arrive in reverse rank order.
        got = [rank async for rank in mesh.sleep_by_rank.stream(0.4)]
        assert got == [2, 1, 0]
        await procs.stop()

    run(main())


def test_broadcast_is_fire_and_forget_and_delivered_in_order():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("counter", Counter, 0)
        for i in range(50):
            assert mesh.record.broadcast(i) is None
        logs = await mesh.get_log.call()
        assert logs.values() == [list(range(50)), list(range(50))]
        await procs.stop()

    run(main())


def test_slicing_proc_and_actor_meshes():
    async def main():
        procs = this_host().spawn_procs(per_host={"dp": 2, "tp": 2})
        assert procs.extent == {"hosts": 1, "dp": 2, "tp": 2}
        mesh = procs.spawn("echo", Echo)
        tp0 = mesh.slice(tp=0)
        assert tp0.extent == {"hosts": 1, "dp": 2}
        vm = await tp0.whoami.call()
        assert [v["coords"] for v in vm.values()] == [{"hosts": 0, "dp": d, "tp": 0} for d in range(2)]
        # message_rank is relative to the slice; rank stays the spawned rank.
        assert [v["rank"] for v in vm.values()] == [0, 2]
        assert [v["message_rank"] for v in vm.values()] == [0, 1]
        kept = mesh.slice(dp=slice(1, 2))
        assert kept.extent == {"hosts": 1, "dp": 1, "tp": 2}
        assert [v["rank"] for v in (await kept.whoami.call()).values()] == [2, 3]
        with pytest.raises(ValueError, match="no dim"):
            mesh.slice(gpus=0)
        with pytest.raises(IndexError):
            mesh.slice(dp=5)
        sub_procs = procs.slice(dp=1)
        assert len(sub_procs) == 2
        await procs.stop()

    run(main())


def test_every_awaitable_takes_a_timeout_and_is_not_consumed():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        mesh = procs.spawn("echo", Echo)
        fut = mesh.sleep_then.call_one(1.0, "late")
        with pytest.raises(CallTimeout, match="did not answer within 0.1"):
            await fut.result(timeout=0.1)
        assert await fut.result(timeout=30) == "late"  # a timeout does not consume it
        slow = mesh.sleep_then.options(timeout=0.1)
        with pytest.raises(CallTimeout):
            await slow.call(1.0, "x")
        with pytest.raises(CallTimeout):
            async for _ in slow.stream(1.0, "x"):
                pass
        await procs.ready(timeout=30)
        await mesh.initialized(timeout=30)
        await procs.stop()

    run(main())
