"""Liveness: worker heartbeats to the process that spawned it, on threads of their own.

Both ends run on dedicated threads with their own sockets, so a busy event loop (a long
compute step in an async endpoint) neither misses a beat nor reports a false death.

- ``Heartbeater`` (in a worker): sends a beat every ``interval``; exits the process when its
  parent is gone (at once: its pidfd turns readable; or the parent pid changed, or no ack for
  ``parent_timeout``): no orphans.
- ``HeartbeatMonitor`` (in a spawner): acks beats and reports a process silent for
  ``timeout`` to the runtime. Lag guard: if the monitor itself was not scheduled for a while
  (a stopped or overloaded machine), it extends every deadline by that lag instead of
  declaring everyone dead.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import msgpack
import zmq

from ._auth import Signer
from ._settings import settings

#: Extra time a new process gets for its first beat (interpreter start-up on a busy machine).
STARTUP_GRACE = 20.0


class HeartbeatMonitor:
    """Acks beats and reports processes gone silent, on a thread of its own."""

    def __init__(self, ctx: zmq.Context, address: str, on_lost: Callable[[str, str], None],
                 clock: Callable[[], float] = time.monotonic):
        self._clock = clock  # monotonic seconds (tests drive the state machine with their own)
        self._thread = threading.Thread(target=self._run, name="relay-heartbeat-monitor", daemon=True)
        self.address = address
        self._ctx = ctx
        self._on_lost = on_lost
        self._signer = Signer()
        cfg = settings()
        self._timeout = cfg.heartbeat_timeout
        self._interval = cfg.heartbeat_interval
        self._lock = threading.Lock()
        self._deadline: dict[str, float] = {}  # proc_id -> monotonic deadline
        self._last: dict[str, float | None] = {}  # proc_id -> last beat (None: none yet)
        self._since: dict[str, float] = {}  # proc_id -> when watching began
        self._unverified: dict[str, int] = {}  # proc_id -> beats naming it that failed the MAC
        self._halt = threading.Event()
        self._ready = threading.Event()
        self.dropped = 0
        self._seen_at: dict[str, float] = {}  # proc_id -> last verified beat, watched or not

    def watch(self, proc_id: str, grace: float = STARTUP_GRACE) -> None:
        """Expect beats from ``proc_id``: one within ``timeout + grace`` (start-up), then
        one every ``timeout``. A beat already received counts (the process beat first)."""
        with self._lock:
            now = self._clock()
            seen = self._seen_at.get(proc_id)
            if seen is not None:
                self._deadline[proc_id] = seen + self._timeout
            else:
                self._deadline[proc_id] = now + self._timeout + grace
            self._last[proc_id] = seen
            self._since[proc_id] = now

    def unwatch(self, proc_id: str) -> None:
        with self._lock:
            self._deadline.pop(proc_id, None)
            self._last.pop(proc_id, None)
            self._since.pop(proc_id, None)

    def stop(self) -> None:
        self._halt.set()

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(5)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self._ready.set()
        poll_ms = max(10, int(self._interval * 1000 / 2))
        last = self._clock()
        try:
            while not self._halt.is_set():
                if sock.poll(poll_ms):
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._beat(sock, frames)
                now = self._clock()
                lag = now - last - poll_ms / 1000
                last = now
                if lag > self._interval:  # we were not scheduled: do not blame the workers
                    self.postpone(lag)
                for proc_id, why in self.expired():
                    self._on_lost(proc_id, why)
        finally:
            sock.close(0)

    def postpone(self, seconds: float) -> None:
        """Move every deadline ``seconds`` later (the monitor itself was not running)."""
        with self._lock:
            for proc_id in self._deadline:
                self._deadline[proc_id] += seconds

    def record_beat(self, proc_id: str) -> None:
        """A verified beat from ``proc_id`` now (also before :meth:`watch`: a remote process
        may beat first)."""
        with self._lock:
            now = self._clock()
            self._seen_at[proc_id] = now
            if proc_id in self._deadline:
                self._deadline[proc_id] = now + self._timeout
                self._last[proc_id] = now

    def expired(self) -> list[tuple[str, str]]:
        """The watched processes past their deadline now, each with why; each is reported
        once (it is no longer watched)."""
        lost = []
        with self._lock:
            now = self._clock()
            for proc_id, deadline in list(self._deadline.items()):
                if now > deadline:
                    last_beat = self._last.pop(proc_id, None)
                    since = self._since.pop(proc_id, now)
                    del self._deadline[proc_id]
                    if last_beat is None:
                        why = f"sent no heartbeat in the {now - since:.1f} s since it was started"
                    else:
                        why = f"missed heartbeats for {now - last_beat:.1f} s (dead, hung or unreachable)"
                    bad = self._unverified.pop(proc_id, 0)
                    if bad:
                        why += f" ({bad} beats naming it failed authentication)"
                    lost.append((proc_id, why))
        return lost

    def _beat(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) != 3 or not self._signer.verify(frames[1], frames[2]):
            self.dropped += 1
            try:  # for the failure message only: an unverified claim is never trusted
                (claimed,) = msgpack.unpackb(frames[-1])
                with self._lock:
                    if claimed in self._deadline:
                        self._unverified[claimed] = self._unverified.get(claimed, 0) + 1
            except Exception:
                pass
            return
        try:
            (proc_id,) = msgpack.unpackb(frames[2])
        except Exception:
            self.dropped += 1
            return
        self.record_beat(proc_id)
        ack = msgpack.packb(["ack"])
        try:
            sock.send_multipart([frames[0], self._signer.sign(ack), ack], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass


class Heartbeater:
    """Beats to a monitor, on a thread of its own; exits the process when its parent is gone."""

    def __init__(self, ctx: zmq.Context, address: str, proc_id: str, parent_pid: int):
        self._thread = threading.Thread(target=self._run, name="relay-heartbeat", daemon=True)
        self._ctx = ctx
        self._address = address
        self._proc_id = proc_id
        self._parent_pid = parent_pid
        cfg = settings()
        self._interval = cfg.heartbeat_interval
        self._parent_timeout = cfg.parent_timeout
        self._signer = Signer()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._address)
        beat = msgpack.packb([self._proc_id])
        mac = self._signer.sign(beat)
        last_ack = time.monotonic()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        parent = self._watch_parent()
        if parent >= 0:
            poller.register(parent, zmq.POLLIN)
        while True:
            if self._parent_pid and os.getppid() != self._parent_pid:
                self._exit("its parent process exited")
            try:
                sock.send_multipart([mac, beat], zmq.NOBLOCK)
            except zmq.Again:
                pass
            deadline = time.monotonic() + self._interval
            while (left := deadline - time.monotonic()) > 0:
                ready = dict(poller.poll(int(left * 1000) + 1))
                if parent in ready:
                    self._exit("its parent process exited")
                if sock in ready:
                    frames = sock.recv_multipart()
                    if len(frames) == 2 and self._signer.verify(frames[0], frames[1]):
                        last_ack = time.monotonic()
            if time.monotonic() - last_ack > self._parent_timeout:
                self._exit(f"its parent sent no heartbeat ack for {self._parent_timeout:.0f} s")

    def _watch_parent(self) -> int:
        """A pidfd of the parent (readable once it exits: the worker exits at once rather than
        at its next beat, so an orphan cannot finish work its dead parent's job gave up), or -1
        where pidfds are unavailable (the per-beat parent-pid check remains)."""
        if not self._parent_pid or not hasattr(os, "pidfd_open"):
            return -1
        try:
            fd = os.pidfd_open(self._parent_pid)
        except OSError:
            return -1  # gone already: the getppid check exits
        if os.getppid() != self._parent_pid:  # the pid was reused by another process
            os.close(fd)
            return -1
        return fd

    def _exit(self, why: str) -> None:
        sys.stderr.write(f"relay worker {self._proc_id} (pid {os.getpid()}): exiting because {why}\n")
        sys.stderr.flush()
        os._exit(1)
