"""``relay judge --config X.yaml [--host H] [--port P] [--token T]``: only the judge — its
engines and the judge service (a process of its own, which serves the HTTP gateway) — on
this machine, until SIGINT/SIGTERM, which drains: no new request is admitted (503), those in
flight are answered (at most ``DRAIN_SECONDS``), then it stops.

The judge's relay secret (which reward code outside this process needs, to reach the judge
over ZeroMQ): ``RELAY_JOB_SECRET`` when exported, else the file ``RELAY_JOB_SECRET_FILE``
names, else a new one each start, written to ``${XDG_CACHE_HOME:-~/.cache}/relay/
judge-<port>.secret`` (mode 0600, removed at a clean stop). It says which, and how a
client gets it, when ready.

``POST /genrm/scale_out`` / ``scale_in`` / ``reconcile`` (reward/scaling.py) add engines on
this node's free GPUs (``gpus_per_node`` of the config; on CPU, virtual bundles) and stop
engines while the judge serves; this process starts and stops them on the service's orders.

An engine whose process dies is replaced: the service serves on the others meanwhile (its
health says ``"degraded": true``), a new process loads the model again and takes the dead
engine's place (at most ``RESPAWNS`` times per engine; docs/failures.md). The service's own
process dying stops the judge (exit 1).

A judge model path that does not exist yet and sits under the cache directory (the tiny
configs' ``${RELAY_CACHE:-.cache}/models/tiny-judge``) is built on first use (a tiny random
Qwen3 with a local tokenizer: no download) and reused afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import relay
from engines.actor import EngineActor
from engines.builtin.tp import FollowerActor
from engines.models.model_builder import ensure_model
from launcher.config import JobConfig
from launcher.config.paths import judge_models, problems_here
from relay import ProcMesh, job_secret, read_secret_file, write_secret_file
from reward.judge import start_judge_service

SECRET_ENV, SECRET_FILE_ENV = "RELAY_JOB_SECRET", "RELAY_JOB_SECRET_FILE"
RESPAWNS = 5  # new engines one engine slot gets before it is left down
ENGINE_LOAD_TIMEOUT = 600.0


class JudgeEngines:
    """The judge's engines, one process each, and their replacement when one dies.

    :meth:`on_failure` is the root's fault hook while the judge runs: the failure of an
    engine process starts a replacement (:meth:`respawn`); any other goes to ``fallback``
    (the default hook: report, stop everything, exit 1)."""

    def __init__(self, cfg: JobConfig, fallback, out=sys.stdout):
        self.cfg = cfg
        self.fallback = fallback
        self.out = out
        self.procs: dict[str, tuple[str, int]] = {}  # an engine process's id -> (instance, index)
        self.meshes: list = []  # every process mesh started, to stop at the end
        self.engine_procs: dict[tuple[str, int], object] = {}  # (instance, index) -> its processes' mesh
        self.retired: set[str] = set()  # processes of replaced engines: their exit is no news
        self.respawns: dict[tuple[str, int], int] = {}
        self.engines: dict[tuple[str, int], object] = {}  # (instance, index) -> its EngineActor mesh, while it runs
        self.gpus: dict[tuple[str, int], list[int]] = {}  # (instance, index) -> its GPU ids (a scaled-out one's too)
        self.tasks: set[asyncio.Task] = set()
        self.service = None  # the JudgeService mesh, once started
        self.closing = False

    async def start(self, name: str, index: int, gpus: list[int] | None = None):
        """Start engine ``index`` of instance ``name`` (on ``gpus``: a scaled-out engine's; by
        default its own, or the config's for its index): one new process per rank (a built-in
        engine over k GPUs is k processes, each seeing its own GPU: rank 0 the engine, ranks
        1..k-1 followers; SGLang's server is one process spanning the GPUs, which takes the
        node's GPUs and ``--base-gpu-id``). Returns the engine's mesh, initialized."""
        inst = self.cfg.genrm[name]
        path = ensure_model(inst.model_path)
        kw = judge_engine_options(self.cfg, name, index, gpus or self.gpus.get((name, index)))
        gpus = self.gpus[(name, index)] = kw["gpu_ids"]
        builtin = self.cfg.engine == "torch"
        ranks = len(gpus) if builtin else 1

        def env(point) -> dict:  # each rank sees its own GPU (on CPU, a label); SGLang's server takes the node's
            return {"CUDA_VISIBLE_DEVICES": str(gpus[point.coords["engines"]])} if builtin else {}

        procs = relay.this_host().spawn_procs(per_host={"engines": ranks}, env=env,
                                              name=f"judge-{name}-{index}".replace("_", ""))
        self.meshes.append(procs)
        self.procs.update((p.proc_id, (name, index)) for p in procs.procs)
        self.engine_procs[(name, index)] = procs
        peers = []
        for rank, p in enumerate(procs.procs[1:], 1):
            follower = ProcMesh.attach([p], name=f"judge-{name}-{index}-tp{rank}").spawn(f"engine-tp{rank}",
                                                                                         FollowerActor)
            await follower.initialized(60)
            peers.append(follower)
        extra = {"tp_peers": peers} if peers else {}
        engine = ProcMesh.attach(procs.procs[:1], name=f"judge-{name}-{index}").spawn(
            "engine", EngineActor, path, self.cfg.engine, **kw, **extra)
        await engine.initialized(ENGINE_LOAD_TIMEOUT)
        self.engines[(name, index)] = engine
        return engine

    async def serve_orders(self, service) -> None:
        """Carry out the judge service's scale orders (reward/scaling.py) until cancelled:
        ``start`` a new engine of an instance on the GPUs the service chose, ``stop`` engines
        it scaled in (their processes, not a failure), ``list`` the engines that run."""
        async def carry_out(order: dict) -> None:
            try:
                result = await self._carry_out(order)
            except Exception as e:  # noqa: BLE001 - the service's request says why
                result = f"{type(e).__name__}: {e}"
            service.scale_done.call_one(order["id"], result)

        while True:
            order = await service.scale_orders.call_one(30.0).result(60)
            if order is not None:  # each in a task of its own: engines of one scale-out load together
                task = asyncio.get_running_loop().create_task(carry_out(order))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _carry_out(self, order: dict):
        name = order.get("route_key")
        if order["op"] == "list":
            live: dict = {}
            for (inst, index), engine in self.engines.items():
                live.setdefault(inst, {})[str(index)] = engine
            return live
        if order["op"] == "start":
            index = 1 + max((i for n, i in self.gpus if n == name), default=-1)
            engine = await self.start(name, index, list(order["gpus"]))
            inst = self.cfg.genrm[name]
            print(f"relay judge: engine {index} of {name!r} added on GPU(s) {order['gpus']}", file=self.out,
                  flush=True)
            return {"engine": engine, "index": index, "placement": {"node": 0, "gpus": list(order["gpus"]),
                                                    "tp": inst.num_gpus_per_engine,
                                                    "dp": inst.engine_config.get("dp_size", 1)}}
        if order["op"] == "stop":
            for index in order["engines"]:
                self.engines.pop((name, index), None)
                procs = self.engine_procs.pop((name, index), None)
                for proc_id in [k for k, v in self.procs.items() if v == (name, index)]:
                    del self.procs[proc_id]
                    self.retired.add(proc_id)
                if procs is not None:
                    await procs.stop(timeout=10.0)
            print(f"relay judge: engine(s) {order['engines']} of {name!r} stopped (scaled in)", file=self.out,
                  flush=True)
            return True
        raise ValueError(f"unknown scale order {order['op']!r}")

    def on_failure(self, failure) -> None:
        if self.closing:
            return
        if failure.proc_id in self.retired:
            return  # another rank of an engine already being replaced
        where = self.procs.pop(failure.proc_id, None)
        if where is None or self.service is None:
            self.fallback(failure)
            return
        for proc_id in [k for k, v in self.procs.items() if v == where]:
            del self.procs[proc_id]  # the engine's other ranks go with it (stopped before the new one starts)
            self.retired.add(proc_id)
        task = asyncio.get_running_loop().create_task(self.respawn(*where, failure))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def respawn(self, name: str, index: int, failure) -> None:
        """Replace engine ``index`` of ``name`` (its process died with ``failure``)."""
        count = self.respawns[(name, index)] = self.respawns.get((name, index), 0) + 1
        if count > RESPAWNS:
            print(f"relay judge: engine {index} of {name!r} died again ({failure.reason}); it was replaced "
                  f"{RESPAWNS} times already and stays down", file=sys.stderr, flush=True)
            return
        print(f"relay judge: engine {index} of {name!r} died ({failure.reason}); serving on the others while "
              f"a new one loads", file=self.out, flush=True)
        t0 = time.monotonic()
        self.engines.pop((name, index), None)
        try:
            old = self.engine_procs.pop((name, index), None)
            if old is not None and len(old.procs) > 1:
                await old.stop(timeout=2.0)  # a tensor-parallel engine's surviving ranks
            engine = await self.start(name, index)
            await self.service.replace_engine.call_one(name, index, engine).result(60)
        except Exception as e:  # noqa: BLE001 - reported; the slot stays down
            print(f"relay judge: the new engine {index} of {name!r} did not start: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            return
        print(f"relay judge: engine {index} of {name!r} is back ({time.monotonic() - t0:.1f} s)",
              file=self.out, flush=True)

    async def stop(self) -> None:
        """Stop every engine (replacements under way are abandoned) and hand the fault hook back."""
        self.closing = True
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for procs in self.meshes:
            await procs.stop()
        relay.set_unhandled_fault_hook(self.fallback)


#: on SIGINT/SIGTERM, how long the requests in flight have to finish before the judge stops
DRAIN_SECONDS = 30.0


def judge_engine_gpus(cfg: JobConfig, name: str) -> list[list[int]]:
    """The GPU ids of each engine of judge ``name``: instances at prefix sums of their
    ``num_gpus``, engines of ``num_gpus_per_engine`` GPUs each."""
    first = 0
    for other, inst in cfg.genrm.items():
        if other == name:
            break
        first += inst.num_gpus
    per = cfg.genrm[name].num_gpus_per_engine
    return [list(range(start, start + per)) for start in range(first, first + cfg.genrm[name].num_gpus - per + 1, per)]


def judge_engine_options(cfg: JobConfig, name: str, index: int, gpus: list[int] | None = None) -> dict:
    """The engine options (``engines.interface.ENGINE_OPTIONS``) of engine ``index`` of
    judge ``name``: weights kept in a CPU backup, no offload (``relay judge`` shares its
    GPUs with nobody), its GPUs (``gpus``, else :func:`judge_engine_gpus`), its engine config."""
    inst = cfg.genrm[name]
    engine_config = dict(inst.engine_config)
    kv_tokens = int(engine_config.pop("kv_cache_tokens", 8192))
    options: dict = {"weights_mode": "backup", "offload": False, "engine_config": engine_config,
                     "gpu_ids": list(gpus) if gpus is not None else judge_engine_gpus(cfg, name)[index]}
    if cfg.device == "cpu":
        options.update(device="cpu", kv_cache_tokens=kv_tokens)
    else:
        options.update(device="cuda", mem_fraction_static=inst.mem_fraction_static or 0.8)
    return options


def secret_file_path(port: int) -> str:
    """Where ``relay judge`` on HTTP port ``port`` writes the secret it generates."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "relay", f"judge-{port}.secret")


def _choose_secret() -> tuple[str, str]:
    """Settle this job's secret before any relay process exists (they inherit it):
    ``("env", "")``, ``("file", path)`` or ``("generated", secret)`` (to be written to a file
    once the port is known). Raises ValueError (what to change) for a bad variable or file."""
    cfg = relay.settings()
    exported, path = cfg.job_secret, cfg.job_secret_file
    secret = job_secret().hex()  # validates RELAY_JOB_SECRET, else reads the file, else makes one and exports it
    if exported:
        return "env", ""
    if path:
        return "file", path
    return "generated", secret


def _secret_lines(addr: str, source: str, path: str) -> list[str]:
    """How reward code outside this process reaches the judge: copy-pasteable exports."""
    if source == "generated":
        return [
            f"relay secret: written to {path} (readable by you only; a new one each start)",
            f"  reward code outside this process: export RELAY_GENRM_ADDR={addr} {SECRET_FILE_ENV}={path}",
            f"  (or instead of the file: export {SECRET_ENV}=$(cat {path}))",
        ]
    if source == "file":
        return [
            f"relay secret: from {path}; reward code outside this process: export RELAY_GENRM_ADDR={addr} "
            f"{SECRET_FILE_ENV}={path}"
        ]
    return [
        f"relay secret: {SECRET_ENV} as exported here; reward code outside this process needs the same value: "
        f"export RELAY_GENRM_ADDR={addr} {SECRET_ENV}=<the same value>"
    ]


async def start_judge(cfg: JobConfig) -> tuple[JudgeEngines, object, object]:
    """Start ``cfg``'s judge on this machine: every instance's engines (a dead one replaced),
    then the judge service over them. Returns (engines, the service's actor mesh, its
    process mesh); stop with ``engines.stop()`` then ``procs.stop()``."""
    engines = JudgeEngines(cfg, relay.set_unhandled_fault_hook(lambda f: engines.on_failure(f)))
    specs = {}
    for name, inst in cfg.genrm.items():
        slices = judge_engine_gpus(cfg, name)
        started = await asyncio.gather(*(engines.start(name, i) for i in range(len(slices))))
        dp = inst.engine_config.get("dp_size", 1)  # SGLang's, inside each engine (refused by the built-in one)
        tp = inst.num_gpus_per_engine
        specs[name] = {
            "model_path": ensure_model(inst.model_path),
            "num_gpus": inst.num_gpus,
            "sampling_config": inst.sampling_config,
            "engines": list(started),
            "placement": [{"node": 0, "gpus": gpus, "tp": tp, "dp": dp} for gpus in slices],
            "num_gpus_per_engine": tp,
            "max_context_len": inst.engine_config.get("max_context_len"),
        }
    judge, judge_procs = await start_judge_service(specs, 600)
    engines.service = judge
    return engines, judge, judge_procs


async def run_judge(cfg: JobConfig, host: str, port: int, token: str | None, ready=None) -> int:
    if not cfg.genrm:
        print("relay judge: the config has no judge (set genrm_model_path or genrm_instances)", file=sys.stderr)
        return 2
    problem = problems_here(judge_models(cfg))
    if problem:
        print(f"relay judge: {problem}", file=sys.stderr)
        return 2
    try:
        secret_source, detail = _choose_secret()  # detail: the file's path, or the generated secret
    except ValueError as e:
        print(f"relay judge: {e}", file=sys.stderr)
        return 2
    engines, judge, judge_procs = await start_judge(cfg)
    await judge.attach_scaler.call_one(cfg.gpus_per_node).result(60)  # this node's GPUs: scale out onto free ones
    orders = asyncio.get_running_loop().create_task(engines.serve_orders(judge))
    try:
        port = await judge.serve_http.call_one(host, port, token, cfg.gateway_limits(),
                                               503 if cfg.genrm_gateway_unhealthy_503 else 200).result(60)
    except relay.ActorError as e:
        print(f"relay judge: {e.exception}", file=sys.stderr)
        orders.cancel()
        await engines.stop()
        await judge_procs.stop()
        return 2
    secret_path = detail if secret_source == "file" else ""
    if secret_source == "generated":
        secret_path = secret_file_path(port)
        write_secret_file(secret_path, detail)
    for line in _secret_lines(judge_procs.procs[0].addr, secret_source, secret_path):
        print(line, flush=True)
    print(
        f"judge ready: http://{host}:{port}/genrm/health  (relay address for reward code: {judge_procs.procs[0].addr})",
        flush=True,
    )
    if ready is not None:
        ready.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    try:  # drain: no new request; those in flight are answered (at most DRAIN_SECONDS)
        drained = await judge.drain.call_one(DRAIN_SECONDS).result(DRAIN_SECONDS + 10)
        print(f"judge stopping: answered {drained['in_flight'] - drained['left']} request(s) in flight"
              + (f", {drained['left']} left unanswered after {DRAIN_SECONDS:g} s" if drained["left"] else ""),
              flush=True)
    except Exception as e:  # noqa: BLE001 - stopping anyway
        print(f"relay judge: drain failed ({type(e).__name__}: {e}); stopping", file=sys.stderr, flush=True)
    orders.cancel()
    await asyncio.gather(orders, return_exceptions=True)
    await engines.stop()
    await judge_procs.stop()
    if secret_source == "generated":
        _remove_secret_file(secret_path, detail)
    print("judge stopped", flush=True)
    return 0


def _remove_secret_file(path: str, value: str) -> None:
    """Remove the secret file we wrote, unless another judge has since rewritten it."""
    try:
        if read_secret_file(path) == value:
            os.unlink(path)
    except (OSError, ValueError):
        pass
