"""torch.distributed bootstrap for a ProcMesh: env vars derived from mesh coordinates."""

from __future__ import annotations

import itertools
import os
import socket

from ._actor import Actor, context, endpoint
from ._settings import settings


class _DistEnv(Actor):
    @endpoint
    def free_port(self) -> tuple[str, int]:
        host = settings().host
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    @endpoint
    def set_env(self, master_addr: str, master_port: int) -> dict[str, str]:
        ctx = context()
        extent = ctx.extent
        last = list(extent)[-1]
        env = {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "RANK": str(ctx.rank),
            "WORLD_SIZE": str(_prod(extent)),
            "LOCAL_RANK": str(ctx.coords[last]),
            "LOCAL_WORLD_SIZE": str(extent[last]),
        }
        os.environ.update(env)
        # Under torchrun, workers inherit TORCHELASTIC_USE_AGENT_STORE=True, which makes
        # torch's env:// rendezvous wait for a store hosted by torchrun's agent at
        # MASTER_ADDR:MASTER_PORT. Here rank 0 hosts the store at the port picked above.
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        return env


def _prod(extent: dict[str, int]) -> int:
    n = 1
    for v in extent.values():
        n *= v
    return n


async def setup_torch_distributed(procs, *, master_port: int | None = None, timeout: float = 60.0) -> list[dict]:
    """Set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE in every
    process of ``procs`` (RANK = row-major rank in the mesh; LOCAL_RANK = coordinate in the
    last dim), so ``torch.distributed.init_process_group()`` works there with ``env://``.
    Rank 0 picks a free port on its host unless ``master_port`` is given. Returns each
    process's env in rank order."""
    name = f"__relay_dist_env_{next(_seq)}"
    mesh = procs.spawn(name, _DistEnv)
    first = mesh._flat([0])
    addr, port = await first.free_port.call_one().result(timeout)
    if master_port is not None:
        port = master_port
    envs = await mesh.set_env.call(addr, port).result(timeout)
    return envs.values()


_seq = itertools.count()
