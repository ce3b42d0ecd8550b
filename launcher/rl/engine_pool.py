"""Engines of the plan (rollout and judge alike): spawning them, calling all of them, their
memory figures and their event logs."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import relay
from relay import ProcMesh, SupervisionError

from ..allocator import Plan
from . import timeouts

#: what a call to an engine whose process is gone raises
GONE = (SupervisionError, ConnectionError)


@dataclass(eq=False)
class PooledEngine:
    """An ``EngineActor`` of one role: ``rollout`` (instance "") or ``genrm`` (instance: the
    judge's name), the ``index``-th engine of its plan claim, on ``bundle`` (the first of its
    slice). ``outstanding`` counts the generations sent to it and not yet answered.

    With ``fault_tolerant`` (``--use-fault-tolerance``) an engine whose process is gone is
    marked ``down`` and left out of every call until :meth:`replaced` (launcher/rl/recovery.py
    builds its successor); without it, its failure fails the call as before."""

    role: str
    instance: str
    mesh: relay.ActorMesh
    index: int = 0
    bundle: int = -1
    fault_tolerant: bool = False
    outstanding: int = 0
    down: str | None = None
    back: asyncio.Event = field(default_factory=asyncio.Event)
    place: dict = field(default_factory=dict)  # node, GPUs, bundles, tp and dp sizes (GET /genrm/engines)

    def mark_down(self, reason: str) -> bool:
        """Leave every call from now on; False when it already had."""
        if self.down is not None:
            return False
        self.down = reason
        self.back.clear()
        return True

    def replaced(self, mesh: relay.ActorMesh) -> None:
        """Its successor (initialized, with current weights) takes its place."""
        self.mesh = mesh
        self.down = None
        self.back.set()


def live(engines: list[PooledEngine]) -> list[PooledEngine]:
    return [e for e in engines if e.down is None]


def engine_options(cfg, claim, weights_mode: str, gpu_ids: list[int], offload: bool) -> dict:
    """The engine options (``engines.interface.ENGINE_OPTIONS``, one contract for both
    backends) of an engine of ``claim`` on the node GPUs ``gpu_ids``; ``offload``: it sleeps
    while other roles use its GPUs (every engine of a colocated layout)."""
    engine_config = dict(cfg.genrm[claim.instance].engine_config) if claim.role == "genrm" else {}
    options: dict = {"weights_mode": weights_mode, "offload": offload, "gpu_ids": list(gpu_ids),
                     "engine_config": engine_config}
    if cfg.device == "cpu":
        engine_config.pop("kv_cache_tokens", None)  # relay train sizes every CPU engine with --kv-cache-tokens
        options.update(device="cpu", kv_cache_tokens=cfg.kv_cache_tokens)
    else:
        options.update(device="cuda", mem_fraction_static=claim.mem_fraction or cfg.sglang_mem_fraction_static)
    return options


def engine_gpus(cfg, claim, engine: PooledEngine) -> list[int]:
    """The node GPU ids of ``engine``'s slice: ``gpus_per_engine`` from its first bundle
    (the allocator keeps a slice on one node, with contiguous ids)."""
    first = engine.bundle % cfg.gpus_per_node
    return list(range(first, first + claim.gpus_per_engine))


def spawn_engines(cfg, plan: Plan, procs_of: Callable[[list], list], roles: tuple[str, ...],
                  colocate: bool) -> tuple[list[PooledEngine], list[Awaitable]]:
    """Spawn every engine of these roles in the plan, each on the first bundle of its slice;
    returns the engines (in plan order) and their initialization awaitables."""
    engines, pending = [], []
    for claim in plan.claims:
        if claim.role not in roles:
            continue
        slices = plan.engines_of(claim)
        # SGLang's data-parallel attention inside each engine (the built-in engine refuses dp_size > 1)
        dp = cfg.genrm[claim.instance].engine_config.get("dp_size", 1) if claim.role == "genrm" else 1
        for i, bundles in enumerate(slices):
            engine = PooledEngine(claim.role, claim.instance, None, i, bundles[0].index, cfg.fault_tolerant)
            engine.place = {"node": bundles[0].node, "gpus": [b.gpu for b in bundles],
                            "bundles": [b.index for b in bundles], "tp": len(bundles), "dp": dp}
            engines.append(engine)
            if cfg.engine == "torch" and len(bundles) > 1:
                pending.append(_tensor_parallel_into(engine, spawn_tensor_parallel(cfg, claim, engine,
                                                                                 procs_of(bundles), colocate)))
                continue
            engine.mesh = spawn_engine(cfg, claim, engine, procs_of(bundles[:1]), colocate)
            pending.append(engine.mesh.initialized(timeouts.MODEL_LOAD))
    return engines, pending


async def spawn_tensor_parallel(cfg, claim, engine: PooledEngine, procs: list, colocate: bool,
                                offload: bool | None = None) -> relay.ActorMesh:
    """A built-in engine over its slice's GPUs (engines/builtin/tp.py): a follower rank on each
    worker of the slice but the first, then the engine itself (rank 0) on the first. Returns
    its mesh once every rank loaded its shard (the ranks' pids and devices in ``engine.place``)."""
    from engines.builtin.tp import FollowerActor

    followers = [ProcMesh.attach([p], name=f"{claim.label()}-e{engine.index}-tp{rank}")
                 .spawn(f"engine-tp{rank}-{claim.role}-{engine.index}", FollowerActor)
                 for rank, p in enumerate(procs[1:], 1)]
    for follower in followers:
        await follower.initialized(timeouts.CONTROL)
    mesh = spawn_engine(cfg, claim, engine, procs[:1], colocate, offload, tp_peers=followers)
    await mesh.initialized(timeouts.MODEL_LOAD)
    ranks = [await mesh.stats.call_one().result(timeouts.CONTROL)]
    ranks += [await f.status.call_one().result(timeouts.CONTROL) for f in followers]
    engine.place.update(pids=[r["pid"] for r in ranks], devices=[r["device"] for r in ranks])
    return mesh


async def _tensor_parallel_into(engine: PooledEngine, spawning: Awaitable) -> None:
    engine.mesh = await spawning


def spawn_engine(cfg, claim, engine: PooledEngine, procs: list, colocate: bool, offload: bool | None = None,
                 **extra) -> relay.ActorMesh:
    """``engine``'s ``EngineActor`` on ``procs`` (its slice's first worker); await its
    ``initialized``. A colocated rollout engine discards its weights when it sleeps (the
    trainer pushes them again); every other engine keeps a CPU backup. In a colocated
    layout every engine sleeps while the trainer trains (``offload``, by default
    ``colocate``). ``extra``: more engine arguments (``tp_peers``)."""
    from engines.actor import EngineActor

    rollout = claim.role == "rollout"
    proc = ProcMesh.attach(procs, name=f"{claim.label()}-e{engine.index}")
    path = cfg.hf_checkpoint if rollout else cfg.genrm[claim.instance].model_path
    weights_mode = "discard" if (rollout and colocate) else "backup"
    name = f"engine-{claim.role}-{claim.instance or 'policy'}-{engine.index}".replace("_", "")
    offload = colocate if offload is None else offload
    options = engine_options(cfg, claim, weights_mode, engine_gpus(cfg, claim, engine), offload)
    return proc.spawn(name, EngineActor, path, cfg.engine, **options, **extra)


def of_role(engines: list[PooledEngine], role: str) -> list[PooledEngine]:
    return [e for e in engines if e.role == role]


async def call_engines(engines: list[PooledEngine], method: str, *args, timeout: float = timeouts.ENGINE_CALL) -> list:
    """``method(*args)`` on every engine not down, at once; the results of those that
    answered, in order. A fault-tolerant engine found gone is marked down and left out; any
    other error is raised."""
    called = live(engines)
    results = await asyncio.gather(*(getattr(e.mesh, method).call_one(*args).result(timeout) for e in called),
                                   return_exceptions=True)
    return answered(called, results)


def answered(engines: list[PooledEngine], results: list) -> list:
    """Of ``results`` (one per engine, exceptions included), those of the engines that
    answered; a fault-tolerant engine found gone is marked down and left out; any other
    error is raised."""
    out = []
    for engine, result in zip(engines, results):
        if isinstance(result, GONE) and engine.fault_tolerant:
            engine.mark_down(f"its process is gone ({result})")
        elif isinstance(result, BaseException):
            raise result
        else:
            out.append(result)
    return out


async def engine_bytes(engines: list[PooledEngine]) -> int:
    """Device bytes the engines hold (their CPU backups not counted)."""
    return held_bytes(await call_engines(engines, "stats"))


def held_bytes(stats: list[dict]) -> int:
    """Device bytes the engines of these ``stats`` hold (their CPU backups not counted)."""
    return int(sum(v for s in stats for k, v in s["bytes"].items() if k != "cpu_backup"))


def graph_capture_s(stats: list[dict]) -> float:
    """The seconds the engines of these ``stats`` spent capturing decode CUDA graphs since
    they started (a sleep and a wake drop the graphs, so each colocated step captures them
    again; 0 for an engine that does not say, as SGLang's)."""
    return sum(float(s.get("cuda_graph_capture_s", 0.0)) for s in stats)


async def all_or_cancel(waits: list[Awaitable]) -> None:
    """Await every start-up step; on a failure, cancel (and retrieve) the others."""
    futures = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.gather(*futures)
    finally:
        for f in futures:
            f.cancel()
        await asyncio.gather(*futures, return_exceptions=True)


async def write_event_log(path: str, rollout: list[PooledEngine], judges: list[PooledEngine], timeout: float,
                          out) -> None:
    """Append one JSON line per engine event to ``path``: engine (``rollout<i>`` /
    ``genrm<i>``), role, instance, t (monotonic, host-wide), event, detail. An engine that
    does not answer within ``timeout`` (dead) is named on ``out`` and left out."""
    engines = rollout + judges
    logs = await asyncio.gather(*(e.mesh.events.call_one().result(timeout) for e in engines), return_exceptions=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        for i, (engine, events) in enumerate(zip(engines, logs)):
            if isinstance(events, BaseException):
                print(f"relay: no event log from {engine.role} engine {engine.instance or i} "
                      f"({type(events).__name__}: {events})", file=out, flush=True)
                continue
            number = i if engine.role == "rollout" else i - len(rollout)
            for t, what, detail in events:
                line = {"engine": f"{engine.role}{number}", "role": engine.role, "instance": engine.instance,
                        "t": t, "event": what, "detail": detail}
                f.write(json.dumps(line) + "\n")
