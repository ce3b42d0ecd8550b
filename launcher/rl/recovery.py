"""Engines that die during training, with ``--use-fault-tolerance`` (docs/failures.md).

A worker process that hosts only engines (rollout or judge: a dedicated pool's bundle) is
started again by its node's agent, and its engines are built anew on it: a rollout engine
gets the trainer's current weights under the current version before it serves again, a
judge engine (weights from its checkpoint) takes the dead one's place in the judge service.
Meanwhile the others go on: a group whose engine died is generated again elsewhere
(launcher/rl/rollout.py), the judge service retries on its other engines, and a sample the
judge could not score is scored again once it can (launcher/rl/scoring.py). A worker that
also hosts a trainer shard is not rebuilt here: the job restarts from its last checkpoint.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable

from . import timeouts
from .engine_pool import PooledEngine, spawn_engine, spawn_tensor_parallel

ENGINE_ROLES = frozenset({"rollout", "genrm"})
REBUILD_ATTEMPTS = 3


class EngineRecovery:
    """Rebuilds the engines of dead engine-only workers.

    ``respawn(node, bundle)`` starts the bundle's worker again (the node agent's
    ``respawn_worker``) and returns its WorkerInfo; ``push(engine, mesh)`` loads the
    trainer's current weights, under the current version, into ``mesh`` (a new rollout
    engine) and has it replace ``engine``, both while no weight sync can start."""

    def __init__(self, cfg, plan, engines: list[PooledEngine], judge, respawn: Callable[[int, int], Awaitable],
                 push: Callable[[PooledEngine, object], Awaitable[None]], out=sys.stdout):
        self.cfg = cfg
        self.plan = plan
        self.engines = engines
        self.judge = judge
        self.respawn = respawn
        self.push = push
        self.out = out
        self.tasks: set[asyncio.Task] = set()
        self.rebuilt = 0  # engines built anew so far
        self.rebuilding: set[PooledEngine] = set()  # engines whose rebuild is under way

    def roles_of(self, bundle: int) -> set[str]:
        return {claim.role for claim in self.plan.claims for b in self.plan.bundles_of(claim) if b.index == bundle}

    def worker_died(self, node: int, bundle: int, failure) -> bool:
        """Take over the failure of bundle ``bundle``'s worker: True when its engines are
        being rebuilt (the job goes on), False when the job must stop (no fault tolerance,
        or a worker of the engines' GPUs hosted more than engines). An engine over several
        GPUs is rebuilt whole: the workers of its other ranks are started again too."""
        if not self.cfg.fault_tolerant:
            return False
        engines = [e for e in self.engines if bundle in _bundles(e)]
        if engines and all(e in self.rebuilding for e in engines):
            return True  # a rank of an engine already being rebuilt (its worker is started again)
        bundles = sorted({b for e in engines for b in _bundles(e)})
        roles = set().union(*(self.roles_of(b) for b in bundles)) if bundles else set()
        if not engines or not roles or not roles <= ENGINE_ROLES:
            return False
        engines = [e for e in self.engines if set(_bundles(e)) & set(bundles)]
        for engine in engines:
            engine.mark_down(f"its process is gone ({failure.reason})")
            self.rebuilding.add(engine)
        others = [b for b in bundles if b != bundle]
        print(f"relay: bundle {bundle} on node {node} ({', '.join(sorted(roles))} engines) died: {failure.reason}; "
              f"building its engines anew{f' (with bundles {others}: the same engine)' if others else ''} while "
              "the others go on", file=self.out, flush=True)
        task = asyncio.get_running_loop().create_task(self._rebuild(node, bundle, bundles, engines))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def _rebuild(self, node: int, bundle: int, bundles: list[int], engines: list[PooledEngine]) -> None:
        started = time.monotonic()
        try:
            for attempt in range(1, REBUILD_ATTEMPTS + 1):
                try:
                    workers = {b: await self.respawn(node, b) for b in bundles}
                    for engine in engines:
                        if engine.down is not None:  # a previous attempt may have brought some back
                            await self._build(engine, [workers[b].proc for b in _bundles(engine)])
                    break
                except Exception as e:  # noqa: BLE001 - tried again, then reported on the engines
                    why = f"rebuild attempt {attempt} of {REBUILD_ATTEMPTS} failed: {type(e).__name__}: {e}"
                    print(f"relay: bundle {bundle}: {why}", file=self.out, flush=True)
                    for engine in engines:
                        engine.down = f"{engine.down}; {why}"
            else:
                return
        finally:
            self.rebuilding.difference_update(engines)
        print(f"relay: bundle {bundle}: {len(engines)} engine(s) back in {time.monotonic() - started:.1f} s",
              file=self.out, flush=True)

    async def _build(self, engine: PooledEngine, procs: list) -> None:
        """``engine``'s successor on ``procs`` (a worker per GPU of its slice) takes its place,
        ready to serve: a rollout engine with the trainer's current weights, a judge engine
        in the judge service."""
        claim = next(c for c in self.plan.claims if c.role == engine.role and c.instance == engine.instance)
        # weights kept in a CPU backup, as a fresh engine's; it sleeps like the one it replaces (an SGLang
        # server needs --enable-memory-saver for that)
        offload = self.plan.layout.colocated
        # a successor's worker hosts no trainer rank to take back KV memory lent on a sleep
        # (engines/kv_pool.py): it frees its cache as a dedicated engine does
        extra = {"lend_kv": False} if self.cfg.engine == "torch" else {}
        if len(procs) > 1:
            mesh = await spawn_tensor_parallel(self.cfg, claim, engine, procs, colocate=False, offload=offload)
        else:
            mesh = spawn_engine(self.cfg, claim, engine, procs, colocate=False, offload=offload, **extra)
            await mesh.initialized(timeouts.MODEL_LOAD)
        if engine.role == "rollout":
            await self.push(engine, mesh)
        else:
            await self.judge.service.replace_engine.call_one(engine.instance, engine.index, mesh).result(
                timeouts.CONTROL)
            engine.replaced(mesh)
        self.rebuilt += 1

    async def settle(self, timeout: float) -> None:
        """Wait for the rebuilds under way (at most ``timeout`` seconds)."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)

    async def record(self, rollout, step: int, version: int, probe_row) -> dict:
        """After the last step of a run that rebuilt engines: once the rebuilds under way are
        done (at most ``timeouts.ENGINE_REBUILD``), every rollout engine's weight version and
        greedy probe (a rebuilt engine answers as a surviving one does)."""
        await self.settle(timeouts.ENGINE_REBUILD)
        return {"kind": "recovery", "step": step, "weight_version": version, "engines/rebuilt": self.rebuilt,
                "engines/down": [e.down for e in self.engines if e.down is not None],
                "sync/engine_versions": await rollout.weight_versions(), **await rollout.probe(probe_row)}

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _bundles(engine: PooledEngine) -> list[int]:
    """The bundles of ``engine``'s GPUs (several for an engine over several GPUs)."""
    return list(engine.place.get("bundles") or [engine.bundle])
