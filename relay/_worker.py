"""Entry point of a spawned worker process: ``python -m relay._worker``.

Environment (set by the spawner): RELAY_PROC_ID, RELAY_BIND (inbox address to bind),
RELAY_PARENT_ADDR (spawner's inbox, for hello and events), RELAY_PARENT_HB (heartbeat
monitor), RELAY_PARENT_PID, RELAY_SYS_PATH (the spawner's sys.path, so actor classes import
the same way), RELAY_MAIN_FILE (the spawner's __main__ script, for classes defined there); optional
RELAY_LOG_FILE (where this process's output goes instead of the console); RELAY_IGNORE_SIGTERM=1
(SIGTERM and SIGUSR1 are ignored: the spawner stops this process).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

from ._settings import Settings, settings


def _prepare_imports(cfg: Settings) -> None:
    for p in reversed(cfg.sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)


def _redirect_output(cfg: Settings) -> None:
    """RELAY_LOG_FILE set: this process's stdout and stderr (Python's and native code's,
    warnings included) are appended to that file instead of the spawner's console."""
    path = cfg.log_file
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main() -> None:
    # Ctrl-C in a terminal reaches the whole process group: the root decides how to stop us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = settings()
    _redirect_output(cfg)
    if cfg.log_level:  # the job's --log-level (its logs go where its stderr goes: the worker's log file)
        from ._settings import configure_logging

        configure_logging(cfg.log_level)
    import zmq

    from ._heartbeat import Heartbeater
    from ._messages import Started
    from ._runtime import Runtime, install_runtime

    proc_id = cfg.proc_id
    Heartbeater(zmq.Context.instance(), cfg.parent_hb, proc_id, cfg.parent_pid).start()
    _prepare_imports(cfg)
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def serve() -> None:
        rt = Runtime(loop, bind=cfg.bind)
        install_runtime(rt)
        addr = rt.ensure_inbox()
        if cfg.ignore_sigterm:
            # The spawner decides when this process stops (slurm signals every process of a
            # job step at once; the controller then checkpoints first). Relay itself stops
            # workers with a message, then SIGKILL; a dead spawner ends them by heartbeat.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        else:
            loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(rt.on_stop()))
        rt.send_to(cfg.parent_addr, Started(proc_id, addr, os.getpid(), socket.gethostname()))
        await rt.stopped

    loop.run_until_complete(serve())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
