"""Tensor parallelism of the built-in engine: an engine over k GPUs is k processes. Rank 0 is
the engine (API, scheduler, sampler, KV bookkeeping); ranks 1..k-1 are followers, each with
its shard of the model (``ModelConfig.shard_for``: heads, MLP and an untied vocabulary split
Megatron-style) and of the KV cache (its KV heads), on its own GPU.

This module launches one (:func:`start_engine`: followers first, then rank 0) and runs the
followers (:class:`FollowerActor`, :func:`follow`); the group itself, its collectives and
rank 0's messages are engines/builtin/tp_group.py.

Rank 0's model runner sends every operation that touches the model or the cache to the
followers before it runs it itself (:meth:`TPGroup.send`: a message broadcast from rank 0
over the group's own process group, then any tensors), so each follower does exactly what
rank 0 does, in the same order: prefill and decode steps (CUDA graphs included), KV block
copies, sleep and wake (with rank 0's KV capacity), weight updates (rank 0 receives the
trainer's full tensors by any transport and broadcasts each bucket; every rank keeps its
shard). The collectives inside a forward (all-reduce after the O and down projections, the
all-gather of a split LM head's logits) keep the ranks in lock step. NCCL on GPU, gloo on CPU.

The group's operations wait up to :data:`IDLE_TIMEOUT` (an engine may stay idle that long
between steps). A follower that dies fails rank 0's next collective (gloo at once; NCCL may
wait, until the launcher stops the engine's processes), and rank 0's process then exits: the
engine is rebuilt whole (``--use-fault-tolerance``, ``relay judge``) or the job stops.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

import relay
from engines.builtin.tp_group import JOIN_TIMEOUT, TPGroup
from engines.settings import settings as engines_settings
from relay import Actor, endpoint

log = logging.getLogger("relay.engine")

def follow(runner, tp: TPGroup) -> None:
    """A follower's loop: run rank 0's operations on its own ``runner`` (a
    :class:`~.model_runner.ModelRunner` of this rank's shard) until ``stop``."""
    from engines.weight_sync import unflatten

    while True:
        op, args = tp.recv()
        if op == "stop":
            return
        try:
            if op == "weights_in":  # a bucket of full tensors follows, broadcast from rank 0
                metas, total = args
                buf = torch.empty(total, dtype=torch.uint8, device=runner.device)
                tp.broadcast(buf)
                runner.weights.copy_in(unflatten(buf, metas))
            elif op.startswith("weights."):
                getattr(runner.weights, op.removeprefix("weights."))(*args)
            else:
                getattr(runner, op)(*args)
        except Exception as e:  # noqa: BLE001 (rank 0 runs the same operation and reports the same error)
            log.warning("tensor-parallel follower rank %d: %s failed: %r", tp.rank, op, e)


class Follower:
    """One follower rank in its own thread: joins the group, builds its shard, then runs
    :func:`follow` until rank 0 stops it. ``error`` holds what ended it otherwise."""

    def __init__(self, model_path: str, address: str, port: int, rank: int, size: int, *, device: str = "cpu",
                 dtype: str | None = None, block_size: int = 16, max_running: int = 256, cpu_threads: int = 1,
                 **runner_kwargs):
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.rank, self.device = rank, device
        self._thread = threading.Thread(
            target=self._run, name=f"tp-follower-{rank}", daemon=True,
            args=(model_path, address, port, rank, size, device, dtype, block_size, max_running, cpu_threads,
                  runner_kwargs))
        self._thread.start()

    def _run(self, model_path, address, port, rank, size, device, dtype, block_size, max_running, cpu_threads,
             runner_kwargs) -> None:
        from engines.builtin.block_manager import BlockManager
        from engines.builtin.model_runner import ModelRunner

        try:
            dev = torch.device(device)
            if dev.type == "cpu":
                torch.set_num_threads(cpu_threads)
            tp = TPGroup(address, port, rank, size, dev)
            dt = getattr(torch, dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
            runner = ModelRunner(model_path, BlockManager(block_size, max_running), device=dev, dtype=dt, tp=tp,
                                 **runner_kwargs)
            follow(runner, tp)
            runner.weights.close()
            tp.close()
        except BaseException as e:  # noqa: BLE001 (kept for status(); rank 0's collectives fail with it)
            log.error("tensor-parallel follower rank %d of %d stopped: %r", rank, size, e)
            self.error = e
        finally:
            self.done.set()

    def status(self) -> dict:
        return {"running": not self.done.is_set(), "error": None if self.error is None else repr(self.error),
                "rank": self.rank, "pid": os.getpid(), "device": self.device}


#: the engine keyword arguments a follower's runner takes (the rest concern rank 0 alone)
_RUNNER_KEYS = ("weights_mode", "name", "kv_cache_tokens", "mem_fraction_static", "cuda_graph", "ep_size")
_RUNNER_DEFAULTS = {"weights_mode": "discard", "name": "engine", "kv_cache_tokens": None,
                    "mem_fraction_static": 0.5, "cuda_graph": True, "ep_size": 1}


class FollowerActor(Actor):
    """A follower rank in a worker process of the engine's slice (its own GPU): started by
    rank 0's :func:`start_engine`."""

    def __init__(self):
        self.follower: Follower | None = None

    @endpoint
    async def start(self, model_path: str, address: str, port: int, rank: int, size: int, engine_kwargs: dict) -> None:
        runner = {k: engine_kwargs.get(k, v) for k, v in _RUNNER_DEFAULTS.items()}
        own = {k: engine_kwargs[k] for k in ("device", "dtype", "block_size", "max_running", "cpu_threads")
               if engine_kwargs.get(k) is not None}
        own.setdefault("cpu_threads", engines_settings().engine_cpu_threads)
        self.follower = Follower(model_path, address, port, rank, size, **own, **runner)

    @endpoint
    async def status(self) -> dict:
        return {"running": False, "error": "not started"} if self.follower is None else self.follower.status()


async def start_engine(model_path: str, peers: list, engine_kwargs: dict, timeout: float = JOIN_TIMEOUT):
    """Rank 0's side: start a follower on each of ``peers`` (:class:`FollowerActor` meshes,
    ranks 1..k-1 in order), then build the engine as rank 0 of the group (it waits for them
    to join, at most ``timeout`` seconds). Returns the :class:`~.engine.TorchEngine`."""
    import asyncio
    import socket

    from engines.builtin.engine import TorchEngine

    host = relay.settings().host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    size = len(peers) + 1
    for rank, peer in enumerate(peers, 1):
        await peer.start.call_one(model_path, host, port, rank, size, engine_kwargs).result(timeout)
    return await asyncio.to_thread(TorchEngine, model_path, tp=(host, port, size), **engine_kwargs)
