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
its environment is set. What the imports print is written again to the log file of each
worker that has one (``RELAY_LOG_FILE``), as if the worker had imported them itself (a
worker writing to the console does not repeat it there). It forks only while it has one
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




def _areas() -> tuple[tuple[int, int], tuple[int, int]]:
    """(arg_start, arg_end), (env_start, env_end): where this process's exec-time command line
    and environment lie in its memory (/proc/self/stat fields 48-51)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # fields[0] is field 3
    arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])
    return (arg_start, arg_end), (env_start, env_end)


def _overwrite(area: tuple[int, int], blob: bytes) -> bool:
    """Write ``blob`` at the start of ``area``, the rest with NULs; False if it does not fit."""
    import ctypes

    start, end = area
    if len(blob) > end - start:
        return False
    ctypes.memmove(start, blob + bytes(end - start - len(blob)), end - start)
    return True


def retitle(env: dict, argv: list[str]) -> str:
    """Show ``argv`` and ``env`` as this process's ``/proc/self/cmdline`` and
    ``/proc/self/environ``, written over the exec-time ones in place (Linux). libc's own
    environment (``getenv``) is first moved off that memory (``clearenv`` + ``setenv``).
    Where a variable keeps its value and everything before it is unchanged, its bytes stay
    where they were (a library may keep a pointer from an earlier ``getenv``): the variables
    the fork server had come first, in its order, then the worker's others, then padding
    (``RELAY_ENVIRON_ROOM=...``) to fill the area. Returns what could not be done ('' if all)."""
    import ctypes

    from relay._forkserver import ROOM_VARIABLE

    try:
        libc = ctypes.CDLL(None)
        args_area, env_area = _areas()
    except (OSError, AttributeError, ValueError, IndexError) as e:
        return f"cannot rewrite /proc/self/cmdline and environ here: {e}"
    if not (args_area[0] and env_area[0]):  # a kernel that does not say (gVisor)
        return "this kernel does not say where /proc/self/cmdline and environ lie: /proc shows the fork server's"
    with open("/proc/self/environ", "rb") as f:
        old = [kv.split(b"=", 1)[0].decode(errors="surrogateescape") for kv in f.read().split(b"\0") if b"=" in kv]
    libc.clearenv()
    for key, value in env.items():
        libc.setenv(os.fsencode(key), os.fsencode(value), 1)
    known = set(old)
    ordered = [k for k in old if k in env] + [k for k in env if k not in known]
    blob = b"".join(os.fsencode(k) + b"=" + os.fsencode(env[k]) + b"\0" for k in ordered)
    room = env_area[1] - env_area[0] - len(blob)
    pad = ROOM_VARIABLE.encode() + b"="
    if room > len(pad):
        blob += pad + b"x" * (room - len(pad) - 1) + b"\0"
    problems = []
    if not _overwrite(env_area, blob):
        problems.append(f"the environment ({len(blob)} bytes) does not fit the fork server's ({room + len(blob)})")
    if not _overwrite(args_area, b"".join(os.fsencode(a) + b"\0" for a in argv)):
        problems.append("the command line does not fit the fork server's")
    return "; ".join(problems)


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
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1):  # a new process's (its main sets its own)
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        problem = retitle(env, [sys.executable, "-m", "relay._worker"])
        if cwd:
            os.chdir(cwd)
        from relay._settings import settings
        from relay._worker import _redirect_output

        cfg = settings()
        _redirect_output(cfg)
        if preload_output and cfg.log_file:  # a log file: as if it had imported them itself
            os.write(2, preload_output)
        if problem:
            os.write(2, f"relay fork server: {problem}\n".encode())
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
    # Ctrl-C, and the SIGTERM / SIGUSR1 a scheduler sends the whole process group before a
    # preemption, reach this process too: the spawner decides (it exits with the spawner)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
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
