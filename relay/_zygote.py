"""A fork server ("zygote"): a process that imports heavy modules once (torch, Megatron,
transformers...) and forks each worker from itself, so that a worker starts with them
already imported instead of importing them again (seconds each, on every worker).

The spawner (relay/_processes.py) starts it with ``python -m relay._zygote REQ REP`` where
REQ and REP are pipe fds: requests come in on REQ, reports go out on REP, one JSON line each:

- request ``{"env": {...}, "cwd": "..."}``: fork a worker whose environment is exactly
  ``env``, in directory ``cwd``; reported
  as ``{"pid": N}`` (or ``{"error": "..."}``), in request order;
- ``{"exit": N, "code": C}``: worker N exited (``C`` < 0: killed by signal -C), as
  ``subprocess.Popen.returncode`` reads.

The zygote imports the modules of ``RELAY_PRELOAD`` (comma-separated) before it serves
the first request, and nothing of relay's own state: a worker reads its settings only after
its environment is set. What the imports print is written again to each worker's output
(its log file), as if the worker had imported them itself. It forks only while it has one
thread (a fork of a threaded process can deadlock the child); otherwise it answers with an
error and the spawner starts that worker as a new process instead. It exits when the
spawner closes REQ or dies (it asks the kernel for SIGKILL on its parent's death); its
workers then see their parent gone and exit (relay/_heartbeat.py).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
import tempfile
import threading
import traceback

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits (Linux; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def threads() -> int:
    """This process's threads, as the kernel counts them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def preload(modules: list[str]) -> None:
    """Import each ``module``, or import ``module`` and call its ``function`` for
    ``module:function``. A failure is reported and skipped (a worker that needs the module
    imports it itself and reports the error where it matters)."""
    for name in modules:
        try:
            module, _, function = name.partition(":")
            imported = importlib.import_module(module)
            if function:
                getattr(imported, function)()
        except Exception as e:  # noqa: BLE001
            sys.stderr.write(f"relay fork server: preloading {name} failed: {type(e).__name__}: {e}\n")


def _child(env: dict, cwd: str | None, req: int, rep: int, preload_output: bytes) -> None:
    """In the forked worker: its own environment, directory and fresh random state, its
    output where a worker's goes (with what the preload printed, as if it had imported the
    modules itself), then the worker's main (which ends the process)."""
    code = 1
    try:
        os.close(req)
        os.close(rep)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        if cwd:
            os.chdir(cwd)
        from relay._settings import settings
        from relay._worker import _redirect_output

        _redirect_output(settings())
        if preload_output:
            os.write(2, preload_output)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        if "torch" in sys.modules:  # each worker its own default seed, as a new process would have
            sys.modules["torch"].seed()
        from relay import _worker

        _worker.main()  # exits the process
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 (reported on the worker's stderr)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(rep: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report(rep, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _report(rep: int, msg: dict) -> None:
    os.write(rep, (json.dumps(msg) + "\n").encode())


def fork_unsafe() -> str:
    """Why forking now would give broken workers ('' when it would not)."""
    if threads() > 1:
        return f"the fork server has {threads()} threads; it forks only with one"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a child could not use CUDA
        return "CUDA was initialized in the fork server (by a preloaded module)"
    return ""


def serve(req: int, rep: int, preload_output: bytes = b"") -> None:
    """Answer fork requests until REQ closes."""
    wake_r, wake_w = os.pipe()  # SIGCHLD wakes the select below
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        ready, _, _ = select.select([req, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(rep)
        if req not in ready:
            continue
        chunk = os.read(req, 1 << 16)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            env, cwd = request["env"], request.get("cwd")
            unsafe = fork_unsafe()
            if unsafe:
                _report(rep, {"error": unsafe})
                continue
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                os.close(wake_r)
                os.close(wake_w)
                _child(env, cwd, req, rep, preload_output)
            _report(rep, {"pid": pid})


def main() -> None:
    die_with_parent()
    if os.getppid() != int(os.environ.get("RELAY_ZYGOTE_PARENT", os.getppid())):
        os._exit(0)  # the spawner died before the kernel was told to kill us with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the spawner decides
    req, rep = int(sys.argv[1]), int(sys.argv[2])
    # What the imports print (library warnings) is kept for the workers' own output.
    console = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 1)
        os.dup2(capture.fileno(), 2)
        try:
            preload([m for m in os.environ.get("RELAY_PRELOAD", "").split(",") if m.strip()])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(console[0], 1)
            os.dup2(console[1], 2)
        capture.seek(0)
        output = capture.read()
    for fd in console:
        os.close(fd)
    try:
        serve(req, rep, output)
    except BrokenPipeError:  # the spawner is gone
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
