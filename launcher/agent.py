"""The node agent: one per node (one torchrun process per node). It spawns one worker
process per GPU bundle it is given, with CUDA_VISIBLE_DEVICES set (on GPU), supervises them,
and reports any worker failure to the controller."""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass

import relay
from engines.settings import settings as engines_settings
from launcher.settings import settings as launcher_settings
from relay import Actor, MeshFailure, ProcRef, endpoint

#: What every worker imports (a trainer shard, engines, the judge service): the node's fork
#: server imports it once, while the job starts, and each worker is forked from it
#: (``relay.prefork``; ``RELAY_FORK_SERVER=0`` starts each worker as a new process instead).
#: Megatron through the import that keeps its JIT fuser off.
WORKER_PRELOAD = (
    "torch",
    "torch._dynamo",  # torch.optim's first optimizer imports it (0.4 s)
    "transformers",
    "engines.trainer.cpu_shim:import_megatron_without_jit_fuser",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "transformers.models.auto.tokenization_auto",
    "engines.builtin",
)


def worker_log(run_dir: str, node: int, bundle: int) -> str:
    """Where a worker's stdout and stderr go (Megatron/torch warnings, native logs)."""
    return os.path.join(run_dir, "logs", f"node{node}-bundle{bundle}.log")


@relay.register(name="launcher.BundleSpec")
@dataclass
class BundleSpec:
    """One worker to start: which bundle, which GPU on this node, what it will host."""

    bundle: int
    gpu: int
    roles: list


@relay.register(name="launcher.WorkerInfo")
@dataclass
class WorkerInfo:
    bundle: int
    node: int
    proc: ProcRef
    roles: list


class NodeAgent(Actor):
    """Hosted in the agent process itself (``this_proc()``); the controller drives it."""

    def __init__(self, node: int, device: str):
        self.node = node
        self.device = device
        self.procs = None
        self.specs: list[BundleSpec] = []
        self.replacements: list = []  # process meshes of workers started again (respawn_worker)
        self.spec_of: dict[str, BundleSpec] = {}  # a worker process's id -> its bundle
        self.worker_of: dict[int, tuple] = {}  # bundle -> (its process mesh, its current worker's ProcRef)
        self.env: dict = {}
        self.controller = None
        self.done = asyncio.Event()
        self.exit_code = 0  # the job's, from the controller's shutdown: this node's process exits with it
        if launcher_settings().fork_server:
            relay.prefork(WORKER_PRELOAD)

    @endpoint
    async def info(self) -> dict:
        return {"node": self.node, "host": socket.gethostname(), "pid": os.getpid()}

    @endpoint
    async def check_paths(self, inputs: list, run_dir: str | None = None) -> dict:
        """Which of ``inputs`` ([flag, path, kind], see launcher/config/paths.py) are missing on this
        node, resolved against this agent's working directory, and why ``run_dir`` cannot be
        written here (None: it can): {"host", "missing": [[flag, path, why]], "unwritable"}."""
        from .config.paths import missing_here, unwritable_here

        return {"host": socket.gethostname(), "missing": missing_here(inputs),
                "unwritable": unwritable_here(run_dir) if run_dir else None}

    @endpoint
    async def spawn_workers(self, specs: list, controller, env: dict) -> list:
        """Start one worker per bundle; return their WorkerInfo once all said hello."""
        if self.procs is not None:
            raise RuntimeError(f"node {self.node}: workers were already spawned")
        self.controller = controller
        self.specs = specs
        self.env = env
        if not specs:
            return []
        self.procs = relay.this_host().spawn_procs(
            per_host={"gpus": len(specs)}, env=lambda point: self._worker_env(specs[point.coords["gpus"]]),
            name=f"node{self.node}"
        )
        # known before their hello: a worker that dies while starting is reported with its bundle
        self.spec_of.update((p.proc_id, s) for s, p in zip(specs, self.procs.procs))
        await self.procs.ready(timeout=120)
        self.worker_of.update((s.bundle, (self.procs, p)) for s, p in zip(specs, self.procs.procs))
        return [WorkerInfo(s.bundle, self.node, p, s.roles) for s, p in zip(specs, self.procs.procs)]

    def _worker_env(self, spec: BundleSpec) -> dict:
        e = dict(self.env)
        e["RELAY_BUNDLE"] = str(spec.bundle)
        e["RELAY_NODE"] = str(self.node)
        if self.env.get("RELAY_JOB_RUN_DIR"):  # library warnings and native logs go here, not to the console
            e["RELAY_LOG_FILE"] = worker_log(self.env["RELAY_JOB_RUN_DIR"], self.node, spec.bundle)
        if self.device == "cuda":
            e["CUDA_VISIBLE_DEVICES"] = str(spec.gpu)
        else:
            e["CUDA_VISIBLE_DEVICES"] = ""  # virtual bundle: never touch a GPU
        return e

    @endpoint
    async def respawn_worker(self, bundle: int) -> WorkerInfo:
        """Start bundle ``bundle``'s worker again; returns the new one's WorkerInfo once it
        said hello. It is supervised like the first. A worker of the bundle still alive (the
        surviving rank of an engine over several GPUs, whose peer died) is stopped first (at
        most 2 s, then killed), which is not reported as a failure."""
        spec = next((s for s in self.specs if s.bundle == bundle), None)
        if spec is None:
            raise ValueError(f"node {self.node} has no bundle {bundle}")
        if bundle in self.worker_of:
            mesh, ref = self.worker_of.pop(bundle)
            await mesh.stop(timeout=2.0, procs=[ref])
        procs = relay.this_host().spawn_procs(per_host={"gpus": 1}, env=lambda point: self._worker_env(spec),
                                              name=f"node{self.node}-b{bundle}")
        self.replacements.append(procs)
        self.spec_of[procs.procs[0].proc_id] = spec
        await procs.ready(timeout=120)
        self.worker_of[bundle] = (procs, procs.procs[0])
        return WorkerInfo(spec.bundle, self.node, procs.procs[0], spec.roles)

    async def __supervise__(self, failure: MeshFailure) -> bool:
        """A worker died: tell the controller (it stops the job or, with fault tolerance,
        has it started again), and count it handled here."""
        if self.controller is not None:
            spec = self.spec_of.get(failure.proc_id)
            try:
                await self.controller.worker_failed.call_one(self.node, spec.bundle if spec else -1, failure).result(
                    timeout=10
                )
            except Exception:
                return False  # the controller is unreachable: fail (and exit) ourselves
        return True

    @endpoint
    async def shutdown(self, timeout: float = 10.0, exit_code: int = 0) -> None:
        """Stop this node's workers; the agent process then exits with the job's ``exit_code``."""
        self.exit_code = exit_code
        for procs in self.replacements:
            await procs.stop(timeout=timeout)
        self.replacements = []
        if self.procs is not None:
            await self.procs.stop(timeout=timeout)
            self.procs = None
        self.done.set()

    @endpoint(concurrent=True)
    async def wait_done(self) -> int:
        """Returns once shut down: the job's exit code."""
        await self.done.wait()
        return self.exit_code


class BundleProbe(Actor):
    """The trivial actor placed on every bundle until the training loop exists."""

    @endpoint
    async def where(self) -> dict:
        return {
            "bundle": engines_settings().bundle,
            "node": engines_settings().node,
            "host": f"{socket.gethostname()}/{relay.settings().host}",  # name / address others reach it at
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "master": f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}",
            "rank": os.environ.get("RANK", ""),
        }
