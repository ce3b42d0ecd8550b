"""Running a job from its config (:func:`run_job`), shared by ``relay train`` / ``relay sft``
(one node) and ``python -m launcher`` (torchrun); the command line (launcher/cli.py) parses
the arguments and loads the config."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time

from .allocator import PlanError
from .config import ConfigError
from .controller import JobFailed, run_agent, run_controller
from .rendezvous import Rank, torchrun_rank, use_network_interface


def install_uvloop() -> None:
    """Use uvloop for asyncio.run() when it is installed."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


def torchrun_restart_problem(max_global_restart: int) -> str | None:
    """Under torchrun with fault tolerance, torchrun restarts the job (``--max-restarts``):
    what is wrong with how it was launched, or None. Outside torchrun, None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    have = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if have >= max_global_restart:
        return None
    return (
        f"--use-fault-tolerance restarts a torchrun job through torchrun, which was started with --max-restarts "
        f"{have}: add --max-restarts {max_global_restart} (at least --max-global-restart) to the torchrun command "
        f"line on every node"
    )


def gateway_port_taken(cfg, grace: float | None = None) -> str | None:
    """Why the judge's HTTP gateway could not listen on its port on this node (another job or
    server is there), checked before anything starts; None when it can, or when no judge serves.
    ``grace`` (default: 10 s with fault tolerance, else 0): how long a taken port may take to
    be freed (a restarted job's previous judge may still be exiting)."""
    import socket

    if not (cfg.prompt_data and cfg.genrm and cfg.genrm_gateway_port):
        return None
    deadline = time.monotonic() + (grace if grace is not None else 10.0 if cfg.fault_tolerant else 0.0)
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway binds: a closed job's port is free
            try:
                s.bind(("127.0.0.1", cfg.genrm_gateway_port))
                return None
            except OSError as e:
                if time.monotonic() >= deadline:
                    return (f"the judge gateway cannot listen on 127.0.0.1:{cfg.genrm_gateway_port} ({e.strerror}: "
                            "another job or server is there); choose another port (--genrm-gateway-port; 0 picks a "
                            "free one)")
        time.sleep(0.2)


def versions_ok(prog: str) -> bool:
    """The version matrix (launcher/versions.py): warnings on stderr; False (said why) when a
    package is too old to run."""
    from .versions import VersionError, check_versions

    try:
        for warning in check_versions():
            print(f"{prog}: warning: {warning}", file=sys.stderr)
    except VersionError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return False
    return True


def run_job(cfg, *, prog: str, single_node: bool, hold: float = 0.0, sft: bool = False) -> int:
    """Run the job of ``cfg`` (a :class:`~launcher.config.JobConfig`, loaded and checked by
    the caller) on this node: the controller on rank 0 (and its node's agent), an agent on
    every other torchrun rank; ``single_node``: ``relay train`` / ``relay sft`` (rank 0 of 1).
    Returns the exit code; errors are printed with ``prog``."""
    if cfg.network_interface:
        try:
            use_network_interface(cfg.network_interface)
        except ConfigError as e:
            print(f"{prog}: {e}", file=sys.stderr)
            return 2
    if cfg.fault_tolerant and not single_node:
        problem = torchrun_restart_problem(cfg.max_global_restart)
        if problem:
            print(f"{prog}: {problem}", file=sys.stderr)
            return 2
    rank = Rank(0, 1) if single_node else (torchrun_rank() or Rank(0, 1))
    if rank.rank == 0 and not sft:
        problem = gateway_port_taken(cfg)
        if problem:
            print(f"{prog}: {problem}", file=sys.stderr)
            return 2
    if cfg.nnodes is None:
        cfg = dataclasses.replace(cfg, nnodes=rank.world_size)
    install_uvloop()
    try:
        if rank.rank == 0:
            if single_node and cfg.nnodes != 1:
                print(
                    f"{prog}: this config needs {cfg.nnodes} nodes; launch it with torchrun (see README) or relay "
                    f"sbatch",
                    file=sys.stderr,
                )
                return 2
            return asyncio.run(
                run_controller(cfg, rank.world_size, hold=hold, mode="sft" if sft else "train")
            )
        return asyncio.run(run_agent(cfg, rank.rank))
    except PlanError as e:
        print(f"{prog}: invalid layout:\n{e}", file=sys.stderr)
        return 2
    except JobFailed as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
