"""The process group of a tensor-parallel built-in engine (engines/builtin/tp.py launches one):
its ranks' collectives inside a forward (all-reduce, all-gather of a split LM head's logits)
and rank 0's operations to the followers (:meth:`TPGroup.send` / :meth:`TPGroup.recv`). NCCL
on GPU, gloo on CPU. A collective that fails on rank 0 means a rank is gone: its process
exits (:data:`EXIT_GROUP_BROKEN`)."""

from __future__ import annotations

import logging
import os
import pickle
from contextlib import contextmanager

import torch

log = logging.getLogger("relay.engine")

IDLE_TIMEOUT = 24 * 3600.0  # seconds a follower waits for rank 0's next operation
JOIN_TIMEOUT = 600.0  # seconds the ranks have to meet
EXIT_GROUP_BROKEN = 70  # rank 0's exit code when a collective fails (a rank is gone)


class TPGroup:
    """The ranks of one engine: a standalone process group (its own TCPStore at rank 0's
    ``address``:``port``), the model's collectives, and rank 0's operations to the followers."""

    def __init__(self, address: str, port: int, rank: int, size: int, device: torch.device,
                 join_timeout: float = JOIN_TIMEOUT):
        from engines.weight_sync import BroadcastGroup

        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.group = BroadcastGroup(address, port, rank, size, backend, join_timeout, f"engine-tp-{port}",
                                    op_timeout_s=IDLE_TIMEOUT)
        self.pg = self.group.pg
        self.closing = False  # rank 0 is closing the engine: a failed collective is no reason to exit

    # ------------------------------------------------------------------ the model's collectives

    @contextmanager
    def _intact(self):
        """Rank 0: a collective that fails means a rank is gone and the group can never run
        in lock step again, so this engine's process exits (code :data:`EXIT_GROUP_BROKEN`,
        the reason logged): its callers see it gone, as any dead engine, and the launcher
        rebuilds the engine whole or stops the job. Not while closing (a follower may have
        stopped first); a follower's error ends its loop (:func:`follow`)."""
        try:
            yield
        except Exception as e:
            if self.rank != 0 or self.closing:
                raise
            log.critical("tensor-parallel engine rank 0 of %d: a collective failed (%r): a rank is gone and the "
                         "engine cannot go on; its process exits", self.size, e)
            logging.shutdown()
            os._exit(EXIT_GROUP_BROKEN)

    def all_reduce(self, x: torch.Tensor) -> None:
        with self._intact():
            self.pg.allreduce([x]).wait()

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self._intact():
            self.pg.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, buf: torch.Tensor) -> None:
        """Rank 0's ``buf`` into every follower's (same size)."""
        with self._intact():
            self.group.broadcast(buf)

    # ------------------------------------------------------------------ rank 0's operations

    def _bcast(self, t: torch.Tensor) -> None:
        """Rank 0's ``t`` to every rank, waited on directly (an operation message is on every
        step's path: no polling; the group's op timeout bounds the wait)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        with self._intact():
            self.pg.broadcast([t], opts).wait()

    def send(self, op: str, *args) -> None:
        """Rank 0: the followers run ``op(*args)`` next (CPU tensors and plain values)."""
        data = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
        self._bcast(torch.tensor([len(data)], dtype=torch.int64, device=self.device))
        self._bcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))

    def recv(self) -> tuple[str, tuple]:
        """A follower: rank 0's next operation."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bcast(size)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._bcast(buf)
        return pickle.loads(buf.cpu().numpy().tobytes())

    def close(self) -> None:
        self.group.close()
