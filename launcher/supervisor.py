"""``relay train --use-fault-tolerance`` on one node: this process supervises the job.

The job (the controller, its agent and workers) runs as a child process: the same
``relay train`` command line, started with ``RELAY_JOB_GENERATION`` set (1, then 2, ...), which
makes it run the job instead of supervising it again. When the child fails (a non-zero exit,
or death by a signal such as ``kill -9``), its process group is killed (nothing of the failed
generation survives) and the job starts again; a generation after the first resumes from the
newest complete checkpoint (``launcher/controller.py`` forces ``--resume``). At most
``--max-global-restart`` restarts: the next failure stops with the child's code.

Not failures, so never restarted: exit 0, a stop after SIGINT/SIGTERM/SIGUSR1 (the supervisor
forwards them to the child and exits with the child's code, e.g. ``EXIT_CHECKPOINTED_ON_SIGNAL``
after a checkpoint), the controller's own signal codes (130, 143, 75) and exit 2 (a bad command
line or layout: starting again cannot help).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from .exitcodes import EXIT_CHECKPOINTED_ON_SIGNAL

#: Set in the job's environment by the supervisor (1 for the first start); read by
#: ``launcher/rendezvous.py``. Its presence also means "run the job, do not supervise".
GENERATION_ENV = "RELAY_JOB_GENERATION"

#: Exit codes that end the job without a restart (see the module docstring).
NOT_FAILURES = frozenset({0, 2, 130, 143, EXIT_CHECKPOINTED_ON_SIGNAL})

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def describe_exit(returncode: int) -> str:
    """``exit N`` for a process that exited, ``signal NAME`` for one killed by a signal
    (``subprocess`` reports those as ``-signum``)."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def shell_code(returncode: int) -> int:
    """The supervisor's own exit code for a child's: its code, or 128 + the signal's number."""
    return returncode if returncode >= 0 else 128 - returncode


@dataclass(frozen=True)
class Verdict:
    """What to do after generation ``restarts_done + 1`` of the job exited."""

    restart: bool
    message: str | None  # one line for stderr, None when there is nothing to say (a clean exit)


def after_exit(returncode: int, restarts_done: int, max_restarts: int, signalled: bool, checkpoints: str) -> Verdict:
    """Pure restart policy: restart after a failure while fewer than ``max_restarts`` restarts
    were made; never after a stop the user asked for (``signalled``) or a code in NOT_FAILURES."""
    if signalled or returncode in NOT_FAILURES:
        return Verdict(False, None)
    how = describe_exit(returncode)
    if restarts_done < max_restarts:
        return Verdict(
            True,
            f"relay: the job failed ({how}); restart {restarts_done + 1} of {max_restarts} from the last "
            f"checkpoint in {checkpoints}",
        )
    return Verdict(
        False,
        f"relay: the job failed ({how}) after {restarts_done} restart(s), the most --max-global-restart "
        f"({max_restarts}) allows; giving up. Continue it with --resume (it restarts from the last checkpoint in "
        f"{checkpoints}), or allow more restarts with --max-global-restart",
    )


def earlier_checkpoints(run_dir: str, resume: bool) -> str | None:
    """A fault-tolerant job that does not ``--resume`` must start in a run directory without
    complete checkpoints: its restarts resume from the newest one, which must be its own.
    The error when an earlier run's are there, else None."""
    from .rl.checkpoints import Checkpoints

    latest = None if resume else Checkpoints(os.path.abspath(run_dir)).latest()
    if latest is None:
        return None
    return (
        f"--use-fault-tolerance: {os.path.dirname(latest)} already holds checkpoints of an earlier run (newest: "
        f"{os.path.basename(latest)}), and a restart would resume from them: pass --resume to continue that run, or "
        f"choose a new --run-dir"
    )


def supervise(argv: list[str], run_dir: str, max_restarts: int, resume: bool = False) -> int:
    """Run ``relay train ARGV`` as a child until it succeeds, is stopped, or has failed
    ``max_restarts + 1`` times; returns the exit code for this process (2 without starting
    it when the run directory holds an earlier run's checkpoints and ``resume`` is off)."""
    from .rl.checkpoints import CHECKPOINT_DIR

    problem = earlier_checkpoints(run_dir, resume)
    if problem:
        print(f"relay train: {problem}", file=sys.stderr, flush=True)
        return 2
    checkpoints = os.path.join(os.path.abspath(run_dir), CHECKPOINT_DIR)
    cmd = [sys.executable, "-m", "launcher.cli", "train", *argv]
    child: subprocess.Popen | None = None
    signalled: list[int] = []

    def forward(signum, _frame) -> None:
        signalled.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        restarts = 0
        while True:
            env = dict(os.environ, **{GENERATION_ENV: str(restarts + 1)})
            # Its own session: a terminal's Ctrl-C reaches it once (forwarded from here), and
            # its whole process group can be killed after a failure.
            child = subprocess.Popen(cmd, env=env, start_new_session=True)
            if signalled:  # a signal that came just before it started
                child.send_signal(signalled[-1])
            code = child.wait()
            _kill_group(child.pid)  # workers of a killed controller (they also exit on their own)
            verdict = after_exit(code, restarts, max_restarts, bool(signalled), checkpoints)
            if verdict.message:
                print(verdict.message, file=sys.stderr, flush=True)
            if not verdict.restart or signalled:  # signalled: stopped while it was failing
                return shell_code(code)
            restarts += 1
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if child is not None and child.poll() is None:  # only on an exception in this function
            child.kill()
            child.wait()
            _kill_group(child.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
