"""torch.distributed over a ProcMesh: env from mesh coordinates, a real gloo all_reduce."""

from __future__ import annotations

import pytest

from relay import setup_torch_distributed, this_host
from tests.helpers import run
from tests.relay.actors import Echo, TorchDist

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_gloo_all_reduce_driven_through_actors():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        envs = await setup_torch_distributed(procs)
        assert [e["RANK"] for e in envs] == ["0", "1"]
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
        echo = procs.spawn("echo", Echo)
        assert (await echo.env.call("RANK")).values() == ["0", "1"]
        dist = procs.spawn("dist", TorchDist)
        # ranks contribute 1.0 and 2.0 -> both see 3.0
        futs = [dist.slice(gpus=i).all_reduce.call_one(float(i + 1)) for i in range(2)]
        assert [await f.result(timeout=90) for f in futs] == [3.0, 3.0]
        await procs.stop()

    run(main())


def test_local_rank_follows_the_last_dim():
    async def main():
        procs = this_host().spawn_procs(per_host={"nodes": 2, "gpus": 2})
        envs = await setup_torch_distributed(procs)
        assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
            ("0", "0", "2"), ("1", "1", "2"), ("2", "0", "2"), ("3", "1", "2")
        ]
        await procs.stop()

    run(main())
