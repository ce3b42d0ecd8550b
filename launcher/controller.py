"""The job: rank 0 runs the controller (and its node's agent); every other rank runs an
agent. ``python -m launcher`` under torchrun and ``relay train`` both end up here.

The controller starts every agent's workers (one per bundle of the plan), places a probe
actor on each and reports the placement (optionally holding the job up for ``--hold``
seconds); then it runs the GRPO loop (``launcher/rl/loop.py``) when the config has
``--prompt-data``, or SFT (``launcher/sft.py``) for ``relay sft``, and shuts everything
down cleanly.

Health: agents heartbeat to the controller and workers to their agent. A dead or silent
agent, or a dead worker (reported by its agent), stops the whole job with a message that
names the node, the bundle and its roles; the controller then exits non-zero. SIGINT stops
everything cleanly; so do SIGTERM and SIGUSR1, except while GRPO trains, when the job first
finishes the step in progress and writes a checkpoint (exit code ``EXIT_CHECKPOINTED_ON_SIGNAL`` on
every node; slurm's preemption warning). Every node's process exits with the job's code. No
process outlives the job: workers exit with their agent, agents exit when the controller
stops acknowledging their heartbeats. With ``--use-fault-tolerance``, torchrun (or ``relay
train``'s supervisor) starts a failed job again and the controller resumes it (``_restarted``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass

import relay
from launcher.settings import settings as launcher_settings
from relay import Actor, MeshFailure, ProcMesh, ProcRef, endpoint, this_proc

from .agent import BundleProbe, BundleSpec, NodeAgent, worker_log
from .allocator import Plan, make_plan, render_plan
from .config import JobConfig
from .config.paths import check_inputs_on_every_node
from .exitcodes import EXIT_CHECKPOINTED_ON_SIGNAL
from .rendezvous import Rendezvous, node_address
from .rl.checkpoints import CHECKPOINT_DIR, StoppedWithCheckpoint
from .run_dir import run_dir_problem, write_config
from .supervisor import earlier_checkpoints

NO_TIMEOUT = 10 * 24 * 3600.0  # seconds: waiting for the next failure report (a job may run for days)


@dataclass
class JobFailed(Exception):
    message: str

    def __str__(self) -> str:
        return self.message


class ControllerSink(Actor):
    """Failure reports for the controller (hosted in its process): the agents' dead workers
    and the runtime's unhandled failures, queued here until the controller takes the next
    (:meth:`next_failure`)."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    @endpoint(concurrent=True)
    async def worker_failed(self, node: int, bundle: int, failure: MeshFailure) -> None:
        self.queue.put_nowait(("worker", node, bundle, failure))

    @endpoint(concurrent=True)
    async def runtime_failed(self, failure: MeshFailure) -> None:
        self.queue.put_nowait(("runtime", -1, -1, failure))

    @endpoint(concurrent=True)
    async def next_failure(self) -> tuple | None:
        """(kind "worker" | "runtime", node, bundle, failure): the next report, once there is one;
        None when the wait is cancelled (the job is shutting down: nothing to report, and no
        traceback from a cancelled endpoint)."""
        try:
            return await self.queue.get()
        except asyncio.CancelledError:
            return None


def _roles_by_bundle(plan: Plan) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for claim in plan.claims:
        for b in plan.bundles_of(claim):
            out.setdefault(b.index, []).append(claim.label())
    return out


def _prepare_process_env(rank: int) -> None:
    os.environ["RELAY_LISTEN"] = "tcp"
    os.environ.setdefault("RELAY_HOST", node_address())
    # Slurm signals every process of a job step at once: only the controller acts on
    # SIGTERM / SIGUSR1 (it checkpoints first); the processes this one spawns ignore them.
    os.environ["RELAY_IGNORE_SIGTERM"] = "1"


# ---------------------------------------------------------------------------- controller


async def run_controller(
    cfg: JobConfig, world_size: int, hold: float = 0.0, out=sys.stdout, mode: str = "train"
) -> int:
    """Rank 0. ``mode`` "train" runs GRPO when the config has ``--prompt-data`` (else it only
    places the job); "sft" runs supervised fine-tuning. Returns the process exit code."""
    plan = make_plan(cfg, train_only=mode == "sft")
    if plan.nnodes != world_size:
        raise JobFailed(
            f"the plan needs {plan.nnodes} node(s) but the job has {world_size}: launch torchrun with "
            f"--nnodes {plan.nnodes}, or set --nnodes / --gpus-per-node to match"
        )
    controller = Controller(cfg, plan, world_size, out, mode)
    await controller.start()
    work = asyncio.ensure_future(controller.place_and_run(hold))
    code, message = await controller.supervise(work)
    return await controller.shut_down(code, message)


class Controller:
    """One job on rank 0, in phases: :meth:`start` (rendezvous, signals, this node's agent),
    :meth:`place_and_run` (every node's workers, the placement report, then the job),
    :meth:`supervise` (until the job ends, fails or is signalled), :meth:`shut_down`."""

    def __init__(self, cfg: JobConfig, plan: Plan, world_size: int, out, mode: str):
        self.cfg, self.plan, self.world_size, self.out, self.mode = cfg, plan, world_size, out, mode
        self.rdzv = Rendezvous()
        self.run_dir = os.path.abspath(cfg.run_dir)
        self.agents: dict[int, relay.ActorMesh] = {}
        self.agent_refs: dict[int, ProcRef] = {}
        self.jobs: list = []  # the GRPO loop or SFT job, once it runs
        self.stop_signal = asyncio.Event()
        self.got_signal: list[str] = []
        self.sink: relay.ActorMesh | None = None

    async def start(self) -> None:
        """Resume after a restart, the job's secret, signal handlers, this process's sink and agent."""
        trains = self.mode == "sft" or bool(self.cfg.prompt_data)
        self.cfg = _restarted(self.cfg, self.rdzv, self.run_dir, self.out, trains)
        _prepare_process_env(0)
        os.environ.setdefault("RELAY_JOB_SECRET", secrets.token_hex(32))
        os.environ.setdefault("RELAY_JOB_ID", secrets.token_hex(8))
        self.rdzv.set("secret", {"secret": relay.settings().job_secret, "job_id": relay.settings().job_id})
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            loop.add_signal_handler(sig, lambda s=sig: (self.got_signal.append(signal.Signals(s).name),
                                                        self.stop_signal.set()))
        here = this_proc()
        self.sink = here.spawn("controller", ControllerSink)
        local_agent = here.spawn("agent", NodeAgent, 0, self.cfg.device)
        await asyncio.gather(self.sink.initialized(), local_agent.initialized())
        relay.set_unhandled_fault_hook(lambda f: self.sink.runtime_failed.call_one(f))
        self.rdzv.set("controller", {"addr": relay.inbox_address(), "hb": relay.heartbeat_address()})
        self.agents[0] = local_agent
        print(render_plan(self.plan), file=self.out, flush=True)

    async def place_and_run(self, hold: float) -> None:
        """Attach every node's agent, check inputs, start the workers and report where each
        runs; then hold (``--hold``) and run the job (GRPO, SFT, or nothing to train)."""
        cfg, plan = self.cfg, self.plan
        for r in range(1, self.world_size):
            info = await self.rdzv.get(f"agent/{r}")
            ref = ProcRef(f"agent{r}", info["addr"], "agents", r, info["host"], info["pid"])
            self.agent_refs[r] = ref
            relay.watch_heartbeats(ref)  # silence for the heartbeat timeout stops the job
            self.agents[r] = ProcMesh.attach([ref], name=f"agent{r}").actors("agent", NodeAgent)
        missing = await check_inputs_on_every_node(cfg, self.mode, self.agents, self.run_dir)  # before any worker
        if missing:
            raise JobFailed(missing)
        grpo = None
        if self.mode != "sft" and cfg.prompt_data:
            from .rl.loop import GRPOLoop

            grpo = GRPOLoop(cfg, plan, self.out, respawn=lambda node, bundle: self.agents[node].respawn_worker.call_one(
                bundle).result(180))
            grpo.prepare()  # while the workers start
        workers = await self._start_workers()
        if hold > 0:
            print(f"holding the job for {hold:g} s", file=self.out, flush=True)
            await asyncio.sleep(hold)
        if self.mode == "sft":
            from .sft import SFTJob

            job = SFTJob(cfg, plan, workers, self.out)
            self.jobs.append(job)
            await job.start()
            await job.run()
        elif grpo is not None:
            self.jobs.append(grpo)
            await grpo.start(workers)
            await grpo.run()
        else:
            print("no --prompt-data: the job was placed; nothing to train", file=self.out, flush=True)

    async def _start_workers(self) -> list:
        """One worker per bundle on every node, torch.distributed for the actor's, a probe
        actor on each; prints where each runs. Returns the workers in bundle order."""
        plan, out, t0 = self.plan, self.out, time.monotonic()
        roles = _roles_by_bundle(plan)
        specs: dict[int, list[BundleSpec]] = {n: [] for n in range(plan.nnodes)}
        for idx in sorted(roles):
            node, gpu = divmod(idx, plan.gpus_per_node)
            specs[node].append(BundleSpec(idx, gpu, roles[idx]))
        env = {"RELAY_JOB_RUN_DIR": self.run_dir}
        per_node = await asyncio.gather(*(self.agents[n].spawn_workers.call_one(specs[n], self.sink, env).result(180)
                                          for n in range(plan.nnodes)))
        workers = sorted((w for ws in per_node for w in ws), key=lambda w: w.bundle)
        procs = ProcMesh.attach([w.proc for w in workers], name="bundles", dims={"bundles": len(workers)})
        # Every role's workers get MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK for its group.
        actor_bundles = [w.proc for w in workers if any(r.split("[")[0] == "actor" for r in w.roles)]
        if actor_bundles:
            await relay.setup_torch_distributed(
                ProcMesh.attach(actor_bundles, name="actor-group", dims={"ranks": len(actor_bundles)})
            )
        where = (await procs.spawn("probe", BundleProbe).where.call().result(120)).values()
        print(f"\nplaced a probe actor on every bundle in {time.monotonic() - t0:.2f} s:", file=out)
        print(f"{'bundle':>6}  {'node':>4}  {'host/address':<24} {'pid':>7}  {'CUDA_VISIBLE_DEVICES':<20} "
              f"{'actor rank':<10} roles", file=out)
        for w, info in zip(workers, where):
            cvd = info["cuda_visible_devices"] or "(cpu)"
            print(f"{w.bundle:>6}  {w.node:>4}  {info['host']:<24} {info['pid']:>7}  {cvd:<20} "
                  f"{info['rank'] or '-':<10} {', '.join(w.roles)}", file=out)
        print(f"workers' own output (library warnings, native logs): {os.path.join(self.run_dir, 'logs')}/", file=out,
              flush=True)
        return workers

    async def supervise(self, work: asyncio.Future) -> tuple[int, str | None]:
        """Wait for ``work`` to end, a failure report or a signal: (exit code, what to say).
        A failure the job takes over (``--use-fault-tolerance``) is not the end; SIGTERM /
        SIGUSR1 while GRPO trains (slurm's warning before preemption or the time limit)
        finishes the step, writes a checkpoint, then stops (repeats, which slurm and torchrun
        send, are ignored); SIGINT stops at once."""
        failure = asyncio.ensure_future(self.sink.next_failure.call_one().result(NO_TIMEOUT))
        stopper = asyncio.ensure_future(self.stop_signal.wait())
        checkpointing = False
        while True:
            done, _ = await asyncio.wait({work, failure, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if failure in done and self.jobs and _taken_over(self.jobs[0], failure.result()):
                failure = asyncio.ensure_future(self.sink.next_failure.call_one().result(NO_TIMEOUT))
                continue
            if stopper in done and len(done) == 1 and self.got_signal[-1] in ("SIGTERM", "SIGUSR1"):
                checkpointing = self._checkpoint_on_signal(checkpointing)
                if checkpointing:
                    self.stop_signal.clear()
                    stopper = asyncio.ensure_future(self.stop_signal.wait())
                    continue
            break
        try:
            return await self._outcome(work, failure, stopper, done)
        finally:
            for f in (work, failure, stopper):
                if not f.done():
                    f.cancel()

    def _checkpoint_on_signal(self, checkpointing: bool) -> bool:
        """SIGTERM / SIGUSR1: ask the job to stop after a checkpoint; whether it is doing so."""
        sig = self.got_signal[-1]
        if checkpointing:
            print(f"relay: {sig} again: still finishing the step and its checkpoint (SIGINT stops at once)",
                  file=sys.stderr, flush=True)
        elif self.jobs and getattr(self.jobs[0], "request_stop", lambda: False)():
            checkpointing = True
            print(f"relay: {sig}: writing a checkpoint after the step in progress, then stopping (exit code "
                  f"{EXIT_CHECKPOINTED_ON_SIGNAL}; SIGINT stops at once)", file=sys.stderr, flush=True)
        return checkpointing

    async def _outcome(self, work, failure, stopper, done) -> tuple[int, str | None]:
        """What ended the job: (exit code, message or None)."""
        plan, refs = self.plan, self.agent_refs
        if work in done and isinstance(work.exception(), StoppedWithCheckpoint):
            return EXIT_CHECKPOINTED_ON_SIGNAL, f"{self.got_signal[0]}: {work.exception()}"
        if failure in done:
            return 1, _describe(failure.result(), plan, refs, self.run_dir)
        if stopper in done:
            last = self.got_signal[-1] if self.got_signal else None
            return (130 if last == "SIGINT" else 143), f"stopped by {last or 'a signal'}; shutting down"
        if work.exception() is None:
            return 0, None
        # A start-up step failed; if it failed because a process died, the supervision
        # report says so more precisely (it may arrive a moment later).
        try:
            return 1, _describe(await asyncio.wait_for(asyncio.shield(failure), 1.0), plan, refs, self.run_dir)
        except asyncio.TimeoutError:
            exc = work.exception()
            message = str(exc) if isinstance(exc, JobFailed) else f"{type(exc).__name__}: {exc}"
            # e.g. a collective failed because another node died: name the node whose agent is
            # gone (its heartbeat timeout may not have passed yet)
            silent = await _silent_agents(self.agents, refs)
            if silent:
                message = "; ".join(
                    f"node {r} agent (host {refs[r].host}, pid {refs[r].pid}) {why}; its workers (bundles "
                    f"{_bundles_of_node(plan, r)}) are lost" for r, why in silent.items()
                ) + f" (first error seen: {message})"
            return 1, message

    async def shut_down(self, code: int, message: str | None) -> int:
        """Say why it ended, close the job (gracefully when it ended well), stop every node."""
        if message:
            print(f"relay: job {'failed' if code == 1 else 'stopped'}: {message}", file=sys.stderr, flush=True)
        for job in self.jobs:
            try:
                await asyncio.wait_for(job.close(graceful=code in (0, EXIT_CHECKPOINTED_ON_SIGNAL)), 90)
            except Exception as e:  # noqa: BLE001 (the workers are stopped next in any case)
                print(f"relay: closing the job: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        await _shutdown(self.agents, self.agent_refs, exit_code=code)
        if code == 0:
            print("shut down cleanly", file=self.out, flush=True)
        return code


def _taken_over(job, item: tuple) -> bool:
    """The job rebuilds what this failure took (a dead engine-only worker, with fault tolerance)."""
    kind, node, bundle, failure = item
    recover = getattr(job, "recover_worker", None)
    return kind == "worker" and recover is not None and recover(node, bundle, failure)


def _restarted(cfg: JobConfig, rdzv: Rendezvous, run_dir: str, out, trains: bool = True) -> JobConfig:
    """The run directory's rules (launcher/run_dir.py) for a job that trains (``trains``):
    a first run may not start in a directory that holds a run without ``--resume``, nor
    resume with changed training keys unless told. With fault tolerance, a run after the
    first (``rdzv.generation`` > 1: torchrun or the one-node supervisor restarted the job
    after a failure) resumes from the newest complete checkpoint. It refuses to run (and so
    do its agents, and later runs: ``rdzv.refuse``) past ``--max-global-restart`` restarts,
    or when a first run without ``--resume`` finds an earlier run's checkpoints, which its
    restarts would resume from."""
    restarts = rdzv.generation - 1 if cfg.fault_tolerant else 0
    message = rdzv.refused() if cfg.fault_tolerant else None
    if not message and restarts == 0:
        message = (earlier_checkpoints(run_dir, cfg.resume) if cfg.fault_tolerant else None) or (
            run_dir_problem(cfg, run_dir) if trains else None)
    if restarts > cfg.max_global_restart and not message:
        message = (
            f"the job failed {restarts} time(s), and --max-global-restart {cfg.max_global_restart} allows "
            f"{cfg.max_global_restart} restart(s); not restarting it again. Continue it with --resume (from the last "
            f"checkpoint in {os.path.join(run_dir, CHECKPOINT_DIR)}) in a new job, or allow more restarts with "
            f"--max-global-restart"
        )
    if message:
        rdzv.refuse(message)
        raise JobFailed(message)
    if trains and restarts == 0:
        write_config(cfg, run_dir)  # RUN_DIR/config.yaml: the resolved config, re-runnable
    if restarts == 0:
        return cfg
    print(
        f"relay: restart {restarts} of {cfg.max_global_restart}: resuming from the newest complete checkpoint in "
        f"{os.path.join(run_dir, CHECKPOINT_DIR)}",
        file=out,
        flush=True,
    )
    return dataclasses.replace(cfg, resume=True)


def _describe(item: tuple, plan: Plan, agent_refs: dict[int, ProcRef], run_dir: str) -> str:
    kind, node, bundle, failure = item
    roles = _roles_by_bundle(plan)
    if kind == "worker":
        return (
            f"node {node} (host {failure.host}): the worker of bundle {bundle} "
            f"(roles: {', '.join(roles.get(bundle, ['?']))}; pid {failure.pid or 'not known yet'}) {failure.reason}; "
            "its output: "
            f"{worker_log(run_dir, node, bundle)}"
        )
    if failure.mesh == "agents":
        return (f"node {failure.rank} agent (host {failure.host}, pid {failure.pid}) {failure.reason}; "
                f"its workers (bundles {_bundles_of_node(plan, failure.rank)}) are lost")
    return str(failure)


def _bundles_of_node(plan: Plan, node: int) -> str:
    start = node * plan.gpus_per_node
    return f"{start}..{start + plan.gpus_per_node - 1}"


async def _silent_agents(
    agents: dict[int, relay.ActorMesh], agent_refs: dict[int, ProcRef], timeout: float = 2.0
) -> dict[int, str]:
    """The other nodes whose agents do not answer a ping within ``timeout``, each with why
    (what relay knows of its death, e.g. the connection dropped, or that it does not answer)."""
    pings = await asyncio.gather(
        *(agents[r].info.call_one().result(timeout) for r in agent_refs), return_exceptions=True
    )
    return {
        r: p.failure.reason if isinstance(p, relay.SupervisionError) else "does not answer"
        for r, p in zip(agent_refs, pings)
        if isinstance(p, BaseException)
    }


async def _shutdown(agents: dict[int, relay.ActorMesh], agent_refs: dict[int, ProcRef], exit_code: int) -> None:
    """Stop every agent's workers, then the agents themselves (best effort, bounded); every
    node's process exits with the job's ``exit_code``."""
    for r in list(agent_refs):
        relay.unwatch_heartbeats(f"agent{r}")
    calls = [a.shutdown.call_one(10.0, exit_code).result(20) for a in agents.values()]
    results = await asyncio.gather(*calls, return_exceptions=True)
    del results  # a dead agent cannot be stopped; its own watchdog ends its workers


# ---------------------------------------------------------------------------- agents


async def run_agent(cfg: JobConfig, rank: int) -> int:
    """Rank > 0: host this node's agent until the controller says stop (or disappears)."""
    rdzv = Rendezvous()
    creds = await rdzv.get("secret")
    if "stop" in creds:  # the controller of this run refused to start (see _restarted)
        print(f"relay: node {rank}: {creds['stop']}", file=sys.stderr, flush=True)
        return 1
    os.environ["RELAY_JOB_SECRET"] = creds["secret"]
    os.environ["RELAY_JOB_ID"] = creds["job_id"]
    os.environ["RELAY_PARENT_TIMEOUT"] = f"{launcher_settings().agent_timeout:g}"  # for this agent and its workers
    _prepare_process_env(rank)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # the controller decides (it checkpoints first)
        loop.add_signal_handler(sig, lambda: None)
    agent = this_proc().spawn("agent", NodeAgent, rank, cfg.device)
    await agent.initialized()
    ctrl = await rdzv.get("controller")
    relay.start_heartbeat(ctrl["hb"], f"agent{rank}")
    rdzv.set(f"agent/{rank}", {"addr": relay.inbox_address(), "host": relay.settings().host, "pid": os.getpid()})
    code = await agent.wait_done.call_one().result(timeout=10 * 24 * 3600)
    if code:
        print(
            f"relay: node {rank}: the job ended with exit code {code} (the head node's log says why)",
            file=sys.stderr,
            flush=True,
        )
    return code
