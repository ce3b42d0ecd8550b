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
from relay import Actor, MeshFailure, ProcMesh, ProcRef, endpoint, this_proc

from .agent import BundleProbe, BundleSpec, NodeAgent, worker_log
from .allocator import Plan, make_plan, render_plan
from .config import JobConfig
from .exitcodes import EXIT_CHECKPOINTED_ON_SIGNAL
from .paths import check_inputs_on_every_node
from .rendezvous import Rendezvous, node_address
from .rl.checkpoints import CHECKPOINT_DIR, StoppedWithCheckpoint
from .supervisor import earlier_checkpoints


@dataclass
class JobFailed(Exception):
    message: str

    def __str__(self) -> str:
        return self.message


class ControllerSink(Actor):
    """Receives reports from agents (hosted in the controller process)."""

    def __init__(self):
        self.queue: asyncio.Queue = _failures()

    @endpoint
    async def worker_failed(self, node: int, bundle: int, failure: MeshFailure) -> None:
        self.queue.put_nowait(("worker", node, bundle, failure))


_queue: asyncio.Queue | None = None


def _failures() -> asyncio.Queue:
    global _queue
    if _queue is None:
        _queue = asyncio.Queue()
    return _queue


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
    rdzv = Rendezvous()
    run_dir = os.path.abspath(cfg.run_dir)
    cfg = _restarted(cfg, rdzv, run_dir, out)
    _prepare_process_env(0)
    os.environ.setdefault("RELAY_JOB_SECRET", secrets.token_hex(32))
    os.environ.setdefault("RELAY_JOB_ID", secrets.token_hex(8))
    rdzv.set("secret", {"secret": relay.settings().job_secret, "job_id": relay.settings().job_id})

    failures = _failures()
    relay.set_unhandled_fault_hook(lambda f: failures.put_nowait(("runtime", -1, -1, f)))
    loop = asyncio.get_running_loop()
    stop_signal = asyncio.Event()
    got_signal: list[str] = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        loop.add_signal_handler(sig, lambda s=sig: (got_signal.append(signal.Signals(s).name), stop_signal.set()))

    here = this_proc()
    sink = here.spawn("controller", ControllerSink)
    local_agent = here.spawn("agent", NodeAgent, 0, cfg.device)
    await asyncio.gather(sink.initialized(), local_agent.initialized())
    rdzv.set("controller", {"addr": relay.inbox_address(), "hb": relay.heartbeat_address()})

    print(render_plan(plan), file=out, flush=True)
    agents: dict[int, relay.ActorMesh] = {0: local_agent}
    agent_refs: dict[int, ProcRef] = {}
    roles = _roles_by_bundle(plan)
    code = 0
    jobs: list = []

    async def body() -> None:
        for r in range(1, world_size):
            info = await rdzv.get(f"agent/{r}")
            ref = ProcRef(f"agent{r}", info["addr"], "agents", r, info["host"], info["pid"])
            agent_refs[r] = ref
            relay.watch_heartbeats(ref)  # silence for the heartbeat timeout stops the job
            agents[r] = ProcMesh.attach([ref], name=f"agent{r}").actors("agent", NodeAgent)
        missing = await check_inputs_on_every_node(cfg, mode, agents, run_dir)  # before any worker starts
        if missing:
            raise JobFailed(missing)
        grpo = None
        if mode != "sft" and cfg.prompt_data:
            from .rl.loop import GRPOLoop

            grpo = GRPOLoop(cfg, plan, out,
                            respawn=lambda node, bundle: agents[node].respawn_worker.call_one(bundle).result(180))
            grpo.prepare()  # while the workers start
        t0 = time.monotonic()
        specs: dict[int, list[BundleSpec]] = {n: [] for n in range(plan.nnodes)}
        for idx in sorted(roles):
            node, gpu = divmod(idx, plan.gpus_per_node)
            specs[node].append(BundleSpec(idx, gpu, roles[idx]))
        env = {"RELAY_JOB_RUN_DIR": run_dir}
        per_node = await asyncio.gather(
            *(agents[n].spawn_workers.call_one(specs[n], sink, env).result(180) for n in range(plan.nnodes))
        )
        workers = sorted((w for ws in per_node for w in ws), key=lambda w: w.bundle)
        procs = ProcMesh.attach([w.proc for w in workers], name="bundles", dims={"bundles": len(workers)})
        # Every role's workers get MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK for its group.
        actor_bundles = [w.proc for w in workers if any(r.split("[")[0] == "actor" for r in w.roles)]
        if actor_bundles:
            await relay.setup_torch_distributed(
                ProcMesh.attach(actor_bundles, name="actor-group", dims={"ranks": len(actor_bundles)})
            )
        probes = procs.spawn("probe", BundleProbe)
        where = (await probes.where.call().result(120)).values()
        print(f"\nplaced a probe actor on every bundle in {time.monotonic() - t0:.2f} s:", file=out)
        print(
            f"{'bundle':>6}  {'node':>4}  {'host/address':<24} {'pid':>7}  {'CUDA_VISIBLE_DEVICES':<20} "
            f"{'actor rank':<10} roles",
            file=out,
        )
        for w, info in zip(workers, where):
            cvd = info["cuda_visible_devices"] or "(cpu)"
            print(
                f"{w.bundle:>6}  {w.node:>4}  {info['host']:<24} {info['pid']:>7}  {cvd:<20} {info['rank'] or '-':<10} "
                f"{', '.join(w.roles)}",
                file=out,
            )
        print(
            f"workers' own output (library warnings, native logs): {os.path.join(run_dir, 'logs')}/",
            file=out,
            flush=True,
        )
        if hold > 0:
            print(f"holding the job for {hold:g} s", file=out, flush=True)
            await asyncio.sleep(hold)
        if mode == "sft":
            from .sft import SFTJob

            job = SFTJob(cfg, plan, workers, out)
            jobs.append(job)
            await job.start()
            await job.run()
        elif grpo is not None:
            jobs.append(grpo)
            await grpo.start(workers)
            await grpo.run()
        else:
            print("no --prompt-data: the job was placed; nothing to train", file=out, flush=True)

    task = asyncio.ensure_future(body())
    waiter = asyncio.ensure_future(failures.get())
    stopper = asyncio.ensure_future(stop_signal.wait())
    checkpointing = False
    while True:
        done, _ = await asyncio.wait({task, waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if waiter in done and jobs and _taken_over(jobs[0], waiter.result()):  # --use-fault-tolerance
            waiter = asyncio.ensure_future(failures.get())
            continue
        # SIGTERM / SIGUSR1 while GRPO trains (slurm's warning before preemption or the time
        # limit): finish the step in progress, write a checkpoint, then stop. Repeats are
        # expected (slurm signals the launcher and torchrun, which forwards it again) and
        # ignored; SIGINT (Ctrl-C) stops at once.
        if stopper in done and len(done) == 1 and got_signal[-1] in ("SIGTERM", "SIGUSR1"):
            if checkpointing:
                print(
                    f"relay: {got_signal[-1]} again: still finishing the step and its checkpoint (SIGINT stops at "
                    f"once)",
                    file=sys.stderr,
                    flush=True,
                )
            elif jobs and getattr(jobs[0], "request_stop", lambda: False)():
                checkpointing = True
                print(
                    f"relay: {got_signal[-1]}: writing a checkpoint after the step in progress, then stopping "
                    f"(exit code {EXIT_CHECKPOINTED_ON_SIGNAL}; SIGINT stops at once)",
                    file=sys.stderr,
                    flush=True,
                )
            if checkpointing:
                stop_signal.clear()
                stopper = asyncio.ensure_future(stop_signal.wait())
                continue
        break
    message = None
    if task in done and isinstance(task.exception(), StoppedWithCheckpoint):
        message = f"{got_signal[0]}: {task.exception()}"
        code = EXIT_CHECKPOINTED_ON_SIGNAL
    elif waiter in done:
        message = _describe(waiter.result(), plan, agent_refs, run_dir)
        code = 1
    elif stopper in done:
        message = f"stopped by {got_signal[-1] if got_signal else 'a signal'}; shutting down"
        code = 130 if got_signal and got_signal[-1] == "SIGINT" else 143
    elif task.exception() is not None:
        # A start-up step failed; if it failed because a process died, the supervision
        # report says so more precisely (it may arrive a moment later).
        try:
            message = _describe(await asyncio.wait_for(asyncio.shield(waiter), 1.0), plan, agent_refs, run_dir)
        except asyncio.TimeoutError:
            exc = task.exception()
            message = str(exc) if isinstance(exc, JobFailed) else f"{type(exc).__name__}: {exc}"
            # e.g. a collective failed because another node died: name the node whose agent is
            # gone (its heartbeat timeout may not have passed yet)
            silent = await _silent_agents(agents, agent_refs)
            if silent:
                message = (
                    "; ".join(
                        f"node {r} agent (host {agent_refs[r].host}, pid {agent_refs[r].pid}) {why}; its workers "
                        f"(bundles {_bundles_of_node(plan, r)}) are lost"
                        for r, why in silent.items()
                    )
                    + f" (first error seen: {message})"
                )
        code = 1
    for f in (task, waiter, stopper):
        if not f.done():
            f.cancel()
    if message:
        print(f"relay: job {'failed' if code == 1 else 'stopped'}: {message}", file=sys.stderr, flush=True)
    for job in jobs:
        try:
            await asyncio.wait_for(job.close(graceful=code in (0, EXIT_CHECKPOINTED_ON_SIGNAL)), 90)
        except Exception as e:  # noqa: BLE001 (the workers are stopped next in any case)
            print(f"relay: closing the job: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    await _shutdown(agents, agent_refs, exit_code=code)
    if code == 0:
        print("shut down cleanly", file=out, flush=True)
    return code


def _taken_over(job, item: tuple) -> bool:
    """The job rebuilds what this failure took (a dead engine-only worker, with fault tolerance)."""
    kind, node, bundle, failure = item
    recover = getattr(job, "recover_worker", None)
    return kind == "worker" and recover is not None and recover(node, bundle, failure)


def _restarted(cfg: JobConfig, rdzv: Rendezvous, run_dir: str, out) -> JobConfig:
    """With fault tolerance, a run after the first (``rdzv.generation`` > 1: torchrun or the
    one-node supervisor restarted the job after a failure) resumes from the newest complete
    checkpoint. It refuses to run (and so do its agents, and later runs: ``rdzv.refuse``)
    past ``--max-global-restart`` restarts, or when a first run without ``--resume`` finds an
    earlier run's checkpoints, which its restarts would resume from."""
    if not cfg.fault_tolerant:
        return cfg
    restarts = rdzv.generation - 1
    message = rdzv.refused() or (earlier_checkpoints(run_dir, cfg.resume) if restarts == 0 else None)
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
    os.environ["RELAY_PARENT_TIMEOUT"] = f"{relay.settings().agent_timeout:g}"  # for this agent and its workers
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
