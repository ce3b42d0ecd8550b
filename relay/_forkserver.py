"""The spawner's side of the fork server (relay/_zygote.py has the server and its protocol).

:func:`relay.prefork` starts one for this process's runtime: from then on its workers are
forked from a process that imported the named modules once, instead of starting a fresh
interpreter that imports them again. :class:`ForkedProc` stands in for the
``subprocess.Popen`` of such a worker (``pid``, ``poll``, ``terminate``, ``kill``, ``wait``):
its exit code comes from the fork server, which is its parent.

Nothing here blocks the event loop: requests are written as the pipe takes them and the
pid comes back later (the server may still be importing), so a worker's ``pid`` is 0 until
then; a signal sent before that is delivered when it arrives. If the server cannot fork a
worker (it has grown threads, or it died), that worker starts as a new process instead.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable

from ._transport import remove_reader

#: Room reserved in the fork server's environment for a worker's own variables (a worker
#: shows its environment in the memory the fork server's occupies: relay/_zygote.py retitle).
#: One variable can be at most 128 KiB (the kernel's MAX_ARG_STRLEN).
ROOM_BYTES = 96 * 1024
#: The padding variable that reserves room for a worker's environment (relay/_zygote.py's ``retitle``).
ROOM_VARIABLE = "RELAY_ENVIRON_ROOM"


def start_worker(env: dict) -> subprocess.Popen:
    """A worker as a new process: ``python -m relay._worker`` with environment ``env``."""
    return subprocess.Popen([sys.executable, "-m", "relay._worker"], env=env, stdin=subprocess.DEVNULL, close_fds=True)


class ForkedProc:
    """A worker forked by the fork server: the part of ``subprocess.Popen`` relay uses."""

    def __init__(self, env: dict, on_exit: Callable[[], None]):
        self.env = env
        self.pid = 0
        self.returncode: int | None = None
        self.on_exit = on_exit
        self._signal: int | None = None  # sent before the pid was known
        self._fallback: subprocess.Popen | None = None

    def poll(self) -> int | None:
        if self._fallback is not None:
            return self._fallback.poll()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self._fallback is not None:
            self._fallback.send_signal(sig)
        elif self.returncode is not None:
            return
        elif not self.pid:
            self._signal = sig
        else:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the exit without the event loop (the exit code may still be on its way:
        None then, or the signal that killed it when relay sent one)."""
        if self._fallback is not None:
            return self._fallback.wait(timeout)
        if self.returncode is None and self.pid:
            try:
                fd = os.pidfd_open(self.pid)
            except (OSError, AttributeError):
                return self.returncode
            try:
                if select.select([fd], [], [], timeout)[0] and self._signal is not None:
                    self.returncode = -self._signal
            finally:
                os.close(fd)
        return self.returncode

    # ---- from the server ----

    def _started(self, pid: int) -> None:
        self.pid = pid
        if self._signal is not None:
            self.send_signal(self._signal)

    def _exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self.on_exit()

    def _start_instead(self) -> None:
        """The server could not fork it: a new process, as without a fork server."""
        self._fallback = start_worker(dict(self.env, RELAY_PARENT_PID=str(os.getpid())))  # its parent: this process
        self.pid = self._fallback.pid
        if self._signal is not None:
            self._fallback.send_signal(self._signal)
        self.on_exit()  # the spawner now watches the new process itself (pidfd or polling)


class ForkServer:
    """One fork server process and the workers it forked (see the module docstring)."""

    def __init__(self, loop, modules: list[str], env: dict):
        self.loop = loop
        req_r, self._req = os.pipe()
        self._rep, rep_w = os.pipe()
        # OpenBLAS starts its threads at import (numpy): the server must stay single-threaded
        # (torch.cuda.is_available() asks NVML, not the CUDA driver, which a fork cannot share)
        child_env = dict(env, RELAY_PRELOAD=",".join(modules), OPENBLAS_NUM_THREADS="1",
                         PYTORCH_NVML_BASED_CUDA_CHECK="1", RELAY_ZYGOTE_PARENT=str(os.getpid()))

        child_env.pop(ROOM_VARIABLE, None)
        child_env[ROOM_VARIABLE] = "x" * ROOM_BYTES  # last: a worker writes its environment over it
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "relay._zygote", str(req_r), str(rep_w)],
                env=child_env, stdin=subprocess.DEVNULL, pass_fds=(req_r, rep_w),
            )
        finally:
            os.close(req_r)
            os.close(rep_w)
        os.set_blocking(self._req, False)
        os.set_blocking(self._rep, False)
        self.pid = self.popen.pid
        self.alive = True
        self._out = b""  # requests the pipe has not taken yet
        self._in = b""
        self._waiting: deque[ForkedProc] = deque()  # requests answered in order
        self._procs: dict[int, ForkedProc] = {}
        loop.add_reader(self._rep, self._on_reports)

    def spawn(self, env: dict, on_exit: Callable[[], None]) -> ForkedProc:
        """Ask for a worker with environment ``env``; ``on_exit`` runs (in the loop) when it
        exited or was started as a new process instead."""
        proc = ForkedProc(env, on_exit)
        if not self.alive:
            self.loop.call_soon(proc._start_instead)
            return proc
        self._waiting.append(proc)
        self._out += (json.dumps({"env": env, "cwd": os.getcwd()}) + "\n").encode()
        self._flush()
        return proc

    def _flush(self) -> None:
        try:
            while self._out:
                n = os.write(self._req, self._out)
                self._out = self._out[n:]
        except BlockingIOError:
            self.loop.add_writer(self._req, self._writable)
        except OSError:
            self._died()

    def _writable(self) -> None:
        self.loop.remove_writer(self._req)
        self._flush()

    def _on_reports(self) -> None:
        try:
            chunk = os.read(self._rep, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._died()
            return
        self._in += chunk
        while b"\n" in self._in:
            line, self._in = self._in.split(b"\n", 1)
            msg = json.loads(line)
            if "exit" in msg:
                proc = self._procs.pop(msg["exit"], None)
                if proc is not None:
                    proc._exited(msg["code"])
                continue
            proc = self._waiting.popleft()
            if "pid" in msg:
                self._procs[msg["pid"]] = proc
                proc._started(msg["pid"])
            else:
                sys.stderr.write(f"relay: {msg.get('error')}; starting the worker as a new process\n")
                proc._start_instead()

    def _died(self, report: bool = True) -> None:
        """The server is gone: its workers die with it (they watch their parent); the
        requests it did not answer start as new processes. ``report``: their exits are
        reported (not when the spawner itself is closing)."""
        if not self.alive:
            return
        self.alive = False
        remove_reader(self.loop, self._rep)
        self.loop.remove_writer(self._req)
        for fd in (self._rep, self._req):
            try:
                os.close(fd)
            except OSError:
                pass
        waiting, self._waiting = list(self._waiting), deque()
        procs, self._procs = list(self._procs.values()), {}
        if not report:
            return
        for proc in waiting:
            proc._start_instead()
        for proc in procs:
            proc._exited(-signal.SIGKILL)

    def close(self) -> None:
        """No more workers: the server exits (its workers were stopped before; any left
        exit with it)."""
        if self.alive:
            self._died(report=False)

    def kill(self) -> None:
        """Kill the server now (its workers then exit: their parent is gone)."""
        try:
            self.popen.kill()
        except ProcessLookupError:
            pass
