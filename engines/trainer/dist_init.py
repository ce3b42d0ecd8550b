"""Joining the trainer's torch.distributed group with a bounded, explained rendezvous."""

from __future__ import annotations

import os

import relay
from engines.settings import settings as engines_settings


def _init_process_group(dist, backend: str) -> None:
    """Join the trainer's torch.distributed group (MASTER_ADDR/PORT, RANK, WORLD_SIZE from
    relay.setup_torch_distributed; rank 0 hosts the store). The rendezvous is bounded by
    ``RELAY_DIST_INIT_TIMEOUT`` seconds (default 60): every rank announces itself in the
    store, and a rank that cannot see all of them in time raises, naming itself and the
    ranks (bundle, node, host) that never came, instead of waiting out torch's 30-minute
    default. Collectives afterwards keep torch's long default timeout."""
    import datetime
    import time

    from torch.distributed import TCPStore

    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    cfg = engines_settings()
    limit = cfg.dist_init_timeout
    me = f"bundle {cfg.bundle}, node {cfg.node}, host {relay.settings().host}"
    where = f"trainer rank {rank} of {world} ({me})"
    hint = (
        "Check that every node is up and reaches that address (RELAY_HOST / the network interface); "
        "RELAY_DIST_INIT_TIMEOUT sets the limit"
    )
    deadline = time.monotonic() + limit
    try:
        store = TCPStore(
            addr, port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=limit), wait_for_workers=False
        )
    except Exception as e:  # noqa: BLE001 (re-raised with who and where)
        raise RuntimeError(
            f"{where}: torch.distributed did not form within {limit:g} s: could not join the store of rank 0 at "
            f"{addr}:{port} "
            f"({e}). {hint}"
        ) from None
    store.set(f"relay/joined/{rank}", where)
    while True:
        missing = [r for r in range(world) if not store.check([f"relay/joined/{r}"])]
        if not missing:
            break
        if time.monotonic() > deadline:
            expected = "; ".join(f"rank {r}" for r in missing)
            raise RuntimeError(
                f"{where}: torch.distributed did not form within {limit:g} s: not every rank joined the store at "
                f"{addr}:{port} "
                f"(missing: {expected}; the controller's placement table says which bundle each rank is). {hint}"
            )
        time.sleep(0.05)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
