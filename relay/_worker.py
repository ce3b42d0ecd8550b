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


def _prepare_imports() -> None:
    extra = [p for p in os.environ.get("RELAY_SYS_PATH", "").split(os.pathsep) if p]
    for p in reversed(extra):
        if p not in sys.path:
            sys.path.insert(0, p)


def _redirect_output() -> None:
    """RELAY_LOG_FILE set: this process's stdout and stderr (Python's and native code's,
    warnings included) are appended to that file instead of the spawner's console."""
    path = os.environ.get("RELAY_LOG_FILE")
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
    _redirect_output()
    import zmq

    from ._heartbeat import Heartbeater
    from ._runtime import K_HELLO, Runtime, install_runtime

    proc_id = os.environ["RELAY_PROC_ID"]
    parent_pid = int(os.environ.get("RELAY_PARENT_PID", "0"))
    Heartbeater(zmq.Context.instance(), os.environ["RELAY_PARENT_HB"], proc_id, parent_pid).start()
    _prepare_imports()
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def serve() -> None:
        rt = Runtime(loop, bind=os.environ["RELAY_BIND"])
        install_runtime(rt)
        addr = rt.ensure_inbox()
        if os.environ.get("RELAY_IGNORE_SIGTERM") == "1":
            # The spawner decides when this process stops (slurm signals every process of a
            # job step at once; the controller then checkpoints first). Relay itself stops
            # workers with a message, then SIGKILL; a dead spawner ends them by heartbeat.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        else:
            loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(rt._on_stop(b"", 0)))
        rt.send_to(os.environ["RELAY_PARENT_ADDR"], [K_HELLO, proc_id, addr, os.getpid(), socket.gethostname()])
        await rt.stopped

    loop.run_until_complete(serve())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
