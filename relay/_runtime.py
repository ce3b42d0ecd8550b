"""The per-process (per event loop) runtime: sockets, calls in flight, hosted actors, owned
processes and supervision. Private: the public API is in relay/__init__.py.

Wire (all frames after the ROUTER identity): ``[mac, header, *buffers]`` where ``header`` is a
msgpack list whose first item is the message kind. Invariants:

- ORDER: one DEALER per (this process, peer inbox) pair, so messages from one sender to one
  process arrive in send order (per-sender FIFO); an actor's mailbox preserves it.
- AUTH: every frame set is verified (relay/_auth.py) before it is decoded; failures are
  dropped, counted in ``stats`` and logged at most once per ``RELAY_AUTH_LOG_INTERVAL``
  seconds. The one answer an unauthenticated sender can get is the constant AUTH_REJECTED,
  and only to a hello (``authenticate``), at most ``_REJECT_BURST`` at once and
  ``_REJECT_RATE`` per second.
- NO-HANG: every call in flight is failed with SupervisionError when its target process is
  known dead (pidfd exit, missed heartbeats, lost connection, owner event) or stopped.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextvars
import functools
import importlib
import importlib.util
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from . import _shm, _wire
from ._actor import _current, _message_rank, endpoints_of
from ._auth import AUTH_REJECTED, MAC_SIZE, Signer, TokenBucket, secret_advice, secret_origin
from ._errors import ActorError, AuthenticationError, MeshFailure, SupervisionError
from ._heartbeat import STARTUP_GRACE, HeartbeatMonitor
from ._shape import Point

K_CALL, K_REPLY, K_SPAWN, K_STOP, K_HELLO, K_EVENT, K_AUTH = 1, 2, 3, 4, 5, 6, 7
# A hello's header, [K_AUTH, rid, nonce] with a 32-character hex nonce, packs to a fixarray
# of 3 whose first item is the fixint K_AUTH, 37..45 bytes in all: an unauthenticated
# message is recognized as a hello by these bytes alone, without decoding it.
_HELLO_PREFIX = bytes([0x93, K_AUTH])
_HELLO_MAX = 45
_REJECT_RATE, _REJECT_BURST = 1.0, 10  # AUTH_REJECTED replies: per second, at once
AUTH_TIMEOUT = 5.0  # seconds a handshake waits for its ack
_SMALL_HEADER = 4096  # headers up to this size share a frame with their MAC
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)
# Encoded arguments/results up to this size ride inside the (fully MAC'd) header; larger
# ones travel as the first buffer frame (MAC covers their size; see relay/_auth.py).
_INLINE_PAYLOAD = 64 * 1024


_zsend = zmq.Socket.__mro__[1].send  # the Cython socket methods: no per-call enum work
_zrecv = zmq.Socket.__mro__[1].recv
_SNDMORE, _RCVMORE = int(zmq.SNDMORE), int(zmq.RCVMORE)


def _send_frames(sock: zmq.Socket, frames: list, n_small: int) -> None:
    """Send one message; the first ``n_small`` frames are copied, the rest (buffers) not."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        _zsend(sock, f, _SNDMORE if i < last else 0, i < n_small)


def _recv_frames(sock: zmq.Socket, n_small: int) -> list:
    """Receive one message (raises zmq.Again when none is waiting). The routing frames and
    the mac/header frame are copied into bytes; buffer frames stay zero-copy zmq.Frames."""
    frames = [_zrecv(sock, _NOBLOCK, True)]
    while sock.getsockopt(_RCVMORE):
        frames.append(_zrecv(sock, 0, len(frames) <= n_small))
    return frames


def _payload_of(bufs: list) -> tuple[memoryview, list]:
    if not bufs:
        raise ValueError("message announces a payload frame but has none")
    return _wire.buffer_of(bufs[0]), bufs[1:]
R_OK, R_ERROR, R_DEAD = 0, 1, 2

_packb = _wire.packb


def _unpack_header(data) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


@dataclass
class ProcRef:
    """Where a process of a mesh lives; ``addr`` is its inbox (ROUTER) address."""

    proc_id: str
    addr: str
    mesh: str
    rank: int
    host: str = ""
    pid: int = 0


_wire.register(ProcRef, name="relay.ProcRef")


@dataclass
class _Owned:
    ref: ProcRef
    popen: subprocess.Popen
    owner_actor: str
    hello: asyncio.Future
    exited: asyncio.Future
    stopping: bool = False
    pidfd: int = -1


@dataclass
class _Peer:
    addr: str
    sock: zmq.Socket
    monitor: zmq.Socket | None
    local: bool = False  # same host: large buffers may go through shared memory
    pending: set = field(default_factory=set)


class _Pending:
    __slots__ = ("fut", "peer", "actor", "method")

    def __init__(self, fut, peer, actor, method):
        self.fut = fut
        self.peer = peer
        self.actor = actor
        self.method = method


def _hostname() -> str:
    return os.environ.get("RELAY_HOST", "127.0.0.1")


def _log_interval() -> float:
    raw = os.environ.get("RELAY_AUTH_LOG_INTERVAL", "10")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"RELAY_AUTH_LOG_INTERVAL must be a number of seconds >= 0, got {raw!r}")
    return value


def _no_ack_message(addr: str, timeout: float) -> str:
    nothing = ""
    if addr.startswith("ipc://") and not os.path.exists(addr[len("ipc://"):]):
        nothing = f" (nothing listens there: no socket file {addr[len('ipc://'):]})"
    return (
        f"no authenticated answer from the relay process at {addr} within {timeout:g} s{nothing}: "
        f"either no relay process runs there, or it does not share this process's secret "
        f"({secret_origin()}). {secret_advice()}."
    )


# ------------------------------------------------------------------------------------------
# Fault hook (root of the supervision tree)


def _default_fault_hook(failure: MeshFailure) -> None:
    sys.stderr.write(f"relay: unhandled failure, stopping the job:\n  {failure}\n")
    sys.stderr.flush()
    for rt in list(_runtimes.values()):
        rt.kill_all()
    os._exit(1)


_fault_hook: Callable[[MeshFailure], Any] = _default_fault_hook


def set_unhandled_fault_hook(hook: Callable[[MeshFailure], Any]) -> Callable[[MeshFailure], Any]:
    """Replace what happens to a failure nobody handled (default: print it, kill every
    process this one spawned, exit 1). Returns the previous hook."""
    global _fault_hook
    prev, _fault_hook = _fault_hook, hook
    return prev


# ------------------------------------------------------------------------------------------


class Runtime:
    """All relay state of one event loop in one process."""

    def __init__(self, loop: asyncio.AbstractEventLoop, bind: str | None = None):
        self.loop = loop
        self.thread_id = threading.get_ident()
        self.proc_id = os.environ.get("RELAY_PROC_ID", f"root-{os.getpid()}")
        self.signer = Signer()
        self.ctx = zmq.Context.instance()
        self.stats: collections.Counter = collections.Counter()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._peers: dict[str, _Peer] = {}
        self._monitors: dict[int, _Peer] = {}
        self._dead: dict[str, MeshFailure] = {}  # inbox addr -> why it is dead
        self._actors: dict[str, _ActorHost] = {}
        self._failed_spawns: dict[str, MeshFailure] = {}
        self._owned: dict[str, _Owned] = {}  # proc_id -> owned process
        self._remote: dict[str, tuple] = {}  # proc_id -> (ProcRef, owner actor): watched, not owned
        self._mesh_seq = itertools.count()
        self._inbox: zmq.Socket | None = None
        self.address: str | None = None
        self._bind = bind
        self._tmpdir: str | None = None
        self._hb: HeartbeatMonitor | None = None
        self._closed = False
        self._inbox_local = False
        self._rejects = TokenBucket(_REJECT_RATE, _REJECT_BURST)
        self._unauth_log_interval = _log_interval()
        self._unauth_unlogged = 0  # dropped since the last log line
        self._unauth_log_at = 0.0  # monotonic time before which no line is written
        self._unauth_log_handle: asyncio.TimerHandle | None = None
        if "RELAY_JOB_ID" not in os.environ:  # this process is the job's root
            os.environ["RELAY_JOB_ID"] = secrets.token_hex(8)
        self._shm_min = _shm.min_bytes() if _shm.enabled() else 0
        self._owns_shm = "RELAY_PARENT_ADDR" not in os.environ
        if self._shm_min and self._owns_shm:
            _shm.create_job_dir()
        self.stopped = loop.create_future()  # set when a worker is told to stop
        self._keeper = loop.create_task(self._keep()) if loop.is_running() else None

    # ---- lifecycle ------------------------------------------------------------------------

    async def _keep(self) -> None:
        """Lives as long as the loop: when asyncio.run() ends, stop what this loop owns."""
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await self.shutdown()
            raise

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread_id

    def _ipc_dir(self) -> str:
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="relay-", dir=os.environ.get("RELAY_IPC_DIR", "/tmp"))
        return self._tmpdir

    def ensure_inbox(self) -> str:
        if self._inbox is None:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # RELAY_LISTEN=tcp makes a root reachable from other hosts (node agents do this);
            # its workers then listen on tcp too (see spawn_local).
            tcp = os.environ.get("RELAY_LISTEN") == "tcp"
            bind = self._bind or (f"tcp://{_hostname()}:0" if tcp else f"ipc://{self._ipc_dir()}/inbox")
            sock.bind(bind)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.address.startswith("tcp://0.0.0.0:"):
                self.address = self.address.replace("0.0.0.0", _hostname())
            self._inbox = sock
            self._inbox_local = self.address.startswith("ipc://")
            self.loop.add_reader(sock.getsockopt(zmq.FD), self._drain_inbox)
            self.loop.call_soon(self._drain_inbox)
        return self.address

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every owned process (gracefully, then by force) and close sockets."""
        if self._closed:
            return
        owned = [o for o in self._owned.values() if not o.exited.done()]
        if owned:
            try:
                await self.stop_procs([o.ref for o in owned], timeout=timeout)
            except Exception:
                pass
        self.kill_all()
        self.close()

    def kill_all(self) -> None:
        """Kill every owned process now (SIGKILL) and reap it. Safe from any thread or hook."""
        for o in list(self._owned.values()):
            o.stopping = True
            if o.popen.poll() is None:
                try:
                    o.popen.kill()
                except ProcessLookupError:
                    pass
        for o in list(self._owned.values()):
            try:
                o.popen.wait(timeout=5)
            except Exception:
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._hb is not None:
            self._hb.stop()
        if self._unauth_log_handle is not None:
            self._unauth_log_handle.cancel()
            self._unauth_log_handle = None
            if self._unauth_unlogged:
                self._log_unauthenticated()
        for fd in list(self._monitors):
            self._remove_reader(fd)
        self._monitors.clear()
        for peer in self._peers.values():
            self._remove_reader(peer.sock.getsockopt(zmq.FD))
            if peer.monitor is not None:
                # Order matters: libzmq's I/O thread sends monitor events with a blocking
                # send, so a monitored socket must stop monitoring before its reader
                # closes, or the next event (our own close's disconnect) wedges the I/O
                # thread of the whole context.
                peer.sock.disable_monitor()
                peer.monitor.close(0)
            peer.sock.close(0)
        self._peers.clear()
        if self._inbox is not None:
            self._remove_reader(self._inbox.getsockopt(zmq.FD))
            self._inbox.close(0)
        for o in self._owned.values():
            if o.pidfd >= 0:
                self._remove_reader(o.pidfd)
                os.close(o.pidfd)
                o.pidfd = -1
        for p in self._pending.values():
            if not p.fut.done():
                p.fut.set_exception(SupervisionError(_failure_stopped(p.peer.addr, "the runtime shut down")))
        self._pending.clear()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        if self._shm_min and self._owns_shm and not any(r is not self and not r._closed for r in _runtimes.values()):
            _shm.remove_job_dir()
        if self._keeper is not None and not self._keeper.done() and not self.loop.is_closed():
            self._keeper.cancel()
        _runtimes.pop(self.loop, None)

    def _remove_reader(self, fd: int) -> None:
        if not self.loop.is_closed():
            try:
                self.loop.remove_reader(fd)
            except Exception:
                pass

    # ---- sending --------------------------------------------------------------------------

    def peer(self, addr: str) -> _Peer:
        peer = self._peers.get(addr)
        if peer is None:
            if self._closed:
                raise RuntimeError("relay runtime is closed (its event loop ended)")
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(addr)
            peer = _Peer(addr, sock, monitor, local=addr.startswith("ipc://"))
            self._peers[addr] = peer
            self.loop.add_reader(sock.getsockopt(zmq.FD), self._drain_peer, peer)
            mfd = monitor.getsockopt(zmq.FD)
            self._monitors[mfd] = peer
            self.loop.add_reader(mfd, self._drain_monitor, peer)
            # Read the (empty) monitor once now: libzmq signals its fd only when a message
            # arrives on a pipe its reader has found empty, so without this first read the
            # first event (the peer's death) would never wake the loop, and calls to a
            # process this one does not own would wait for it forever.
            self._drain_monitor(peer)
        return peer

    def _send(self, sock: zmq.Socket, prefix: list, header: bytes, buffers: list, peer: _Peer | None = None) -> None:
        mac = self.signer.sign(header, buffers)
        if len(header) <= _SMALL_HEADER:  # one frame: mac || header (see _verify)
            frames = [*prefix, mac + header, *buffers]
        else:
            frames = [*prefix, mac, header, *buffers]
        _send_frames(sock, frames, len(frames) - len(buffers))
        # Edge-triggered ZMQ_FD: a send may consume the readable edge, so look again.
        if sock.getsockopt(_EVENTS) & _POLLIN:
            if peer is None:
                self.loop.call_soon(self._drain_inbox)
            else:
                self.loop.call_soon(self._drain_peer, peer)

    def send_to(self, addr: str, header: list, buffers: list = ()) -> None:
        peer = self.peer(addr)
        self._send(peer.sock, [], _packb(header), list(buffers), peer)

    def call(
        self, ref: ProcRef, actor: str, method: str, mrank: int, payload: bytes, buffers: list, want_reply: bool
    ) -> asyncio.Future | None:
        """Send one call; return the future of its reply (None for fire-and-forget)."""
        dead = self._dead.get(ref.addr)
        if dead is not None:
            if not want_reply:
                return None
            fut = self.loop.create_future()
            fut.set_exception(SupervisionError(dead))
            return fut
        peer = self._peers.get(ref.addr) or self.peer(ref.addr)
        rid = next(self._ids)
        if len(payload) > _INLINE_PAYLOAD:  # its own frame: see _payload_of
            buffers = [payload, *buffers]
            payload = None
        buffers, shm = self._to_shm(buffers, peer.local)
        header = _packb([K_CALL, rid, actor, method, mrank, want_reply, payload, shm])
        fut = None
        if want_reply:
            fut = self.loop.create_future()
            self._pending[rid] = _Pending(fut, peer, actor, method)
            peer.pending.add(rid)
        self._send(peer.sock, [], header, buffers, peer)
        return fut

    def request(self, addr: str, header_tail: list, kind: int) -> asyncio.Future:
        """A control request (spawn, stop) that expects a reply."""
        dead = self._dead.get(addr)
        fut = self.loop.create_future()
        if dead is not None:
            fut.set_exception(SupervisionError(dead))
            return fut
        peer = self.peer(addr)
        rid = next(self._ids)
        self._pending[rid] = _Pending(fut, peer, header_tail[0] if header_tail else "", "<control>")
        peer.pending.add(rid)
        self._send(peer.sock, [], _packb([kind, rid, *header_tail]), [], peer)
        return fut

    # ---- authentication handshake ------------------------------------------------------------

    async def authenticate(self, addr: str, timeout: float = AUTH_TIMEOUT) -> None:
        """Prove that the process at ``addr`` shares this job's secret: send a signed hello
        and wait for its signed ack of a fresh nonce. Raises AuthenticationError when the
        peer rejects the hello (it has another secret) or no ack comes within ``timeout``;
        SupervisionError when the peer is known dead."""
        dead = self._dead.get(addr)
        if dead is not None:
            raise SupervisionError(dead)
        fut = self.loop.create_future()
        peer = self.peer(addr)
        rid = next(self._ids)
        nonce = secrets.token_hex(16)
        self._pending[rid] = _Pending(fut, peer, "", "<auth>")
        peer.pending.add(rid)
        self._send(peer.sock, [], _packb([K_AUTH, rid, nonce]), [], peer)
        try:
            echoed = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            self._pending.pop(rid, None)
            peer.pending.discard(rid)
            raise AuthenticationError(addr, _no_ack_message(addr, timeout)) from None
        if echoed != nonce:  # a signed ack of another hello: a replay
            raise AuthenticationError(addr, f"the process at {addr} answered the authentication handshake with a wrong nonce")

    def _on_auth_rejected(self, peer: _Peer) -> None:
        """The peer rejected our hello (AUTH_REJECTED): fail the handshakes waiting on it."""
        waiting = [rid for rid in peer.pending if getattr(self._pending.get(rid), "method", "") == "<auth>"]
        if not waiting:
            self._unauthenticated()  # unsolicited: dropped like any unsigned message
            return
        err = AuthenticationError(
            peer.addr,
            f"the relay process at {peer.addr} rejected this process: not authenticated, its secret "
            f"differs from the server's ({secret_origin()}). {secret_advice()}.",
        )
        for rid in waiting:
            self._fail_reply(rid, err)

    def _reject_hello(self, ident: bytes) -> None:
        """Answer a hello that did not verify with AUTH_REJECTED, rate-limited. Safe to
        send: a constant that carries nothing, shorter than the hello it answers, to the
        connected peer only (ZeroMQ runs over TCP or a local socket: no spoofed sender)."""
        if not self._rejects.take():
            self.stats["auth_rejections_suppressed"] += 1
            return
        try:
            self._inbox.send_multipart([ident, AUTH_REJECTED], zmq.NOBLOCK)
            self.stats["auth_rejections_sent"] += 1
        except zmq.ZMQError:
            self.stats["reply_unroutable"] += 1

    def _unauthenticated(self) -> None:
        """Count a dropped unauthenticated message; log the count at most once per interval."""
        self.stats["dropped_unauthenticated"] += 1
        self._unauth_unlogged += 1
        if self._unauth_log_handle is None and not self._closed and not self.loop.is_closed():
            delay = max(0.0, self._unauth_log_at - time.monotonic())
            self._unauth_log_handle = self.loop.call_later(delay, self._log_unauthenticated)

    def _log_unauthenticated(self) -> None:
        self._unauth_log_handle = None
        n, self._unauth_unlogged = self._unauth_unlogged, 0
        self._unauth_log_at = time.monotonic() + self._unauth_log_interval
        sys.stderr.write(
            f"relay: process {self.proc_id!r} (pid {os.getpid()}, {self.address or 'no inbox'}) dropped {n} "
            f"unauthenticated message(s) (total {self.stats['dropped_unauthenticated']}): a peer without "
            f"this job's secret (RELAY_JOB_SECRET) is sending to it; at most one such line per "
            f"{self._unauth_log_interval:g} s\n"
        )
        sys.stderr.flush()

    # ---- receiving replies ------------------------------------------------------------------

    def _drain_peer(self, peer: _Peer) -> None:
        sock = peer.sock
        if sock.closed:
            return
        while True:
            try:
                frames = _recv_frames(sock, 0)
            except zmq.ZMQError:  # Again: drained
                return
            if len(frames) == 1 and frames[0] == AUTH_REJECTED:
                self._on_auth_rejected(peer)
                continue
            msg = self._verify(frames, 0)
            if msg is None:
                continue
            header, bufs = msg
            if header[0] == K_REPLY:
                try:
                    bufs = self._from_shm(bufs, header[4])
                except Exception as e:
                    self._fail_reply(header[1], e)
                    continue
                self._on_reply(header, bufs)
            else:
                self.stats["dropped_malformed"] += 1

    def _verify(self, frames: list, skip: int):
        """Check the MAC and decode the header. Frame layout after ``skip`` routing frames:
        ``[mac || header, *buffers]`` for small headers, else ``[mac, header, *buffers]``."""
        if len(frames) <= skip:
            self.stats["dropped_malformed"] += 1
            return None
        first = memoryview(frames[skip])
        if len(first) > MAC_SIZE:
            mac, hbuf, bufs = first[:MAC_SIZE], first[MAC_SIZE:], frames[skip + 1 :]
        elif len(frames) >= skip + 2:
            mac, hbuf, bufs = first, _wire.buffer_of(frames[skip + 1]), frames[skip + 2 :]
        else:
            self.stats["dropped_malformed"] += 1
            return None
        if not self.signer.verify(mac, hbuf, [b.buffer for b in bufs] if bufs else ()):
            self._unauthenticated()
            if skip == 1 and not bufs and len(hbuf) <= _HELLO_MAX and hbuf[:2] == _HELLO_PREFIX:
                self._reject_hello(frames[0])
            return None
        try:
            decoded = _unpack_header(hbuf)
        except Exception:
            self.stats["dropped_malformed"] += 1
            return None
        if not isinstance(decoded, list) or not decoded:
            self.stats["dropped_malformed"] += 1
            return None
        return decoded, bufs

    def _to_shm(self, buffers: list, local: bool) -> tuple[list, list | None]:
        """Move large buffers for a same-host peer into shared memory (relay/_shm.py)."""
        if not local or not buffers or not self._shm_min:
            return buffers, None
        out, shm = None, None
        for i, b in enumerate(buffers):
            n = b.nbytes if hasattr(b, "nbytes") else len(b)
            if n >= self._shm_min:
                if out is None:
                    out, shm = list(buffers), []
                shm.append([i, _shm.write(b), n])
                out[i] = b""
                self.stats["shm_buffers_sent"] += 1
        return (out, shm) if out is not None else (buffers, None)

    @staticmethod
    def _from_shm(bufs: list, shm: list | None) -> list:
        if not shm:
            return bufs
        bufs = list(bufs)
        try:
            for i, name, size in shm:
                bufs[i] = _shm.take(name, size)
        except BaseException:
            _shm.release([entry[1] for entry in shm])
            raise
        return bufs

    def _fail_reply(self, rid: int, exc: BaseException) -> None:
        p = self._pending.pop(rid, None)
        if p is not None:
            p.peer.pending.discard(rid)
            if not p.fut.done():
                p.fut.set_exception(exc)

    def _on_reply(self, header: list, bufs: list) -> None:
        _, rid, status, payload = header[:4]
        if payload is None:
            payload, bufs = _payload_of(bufs)
        p = self._pending.pop(rid, None)
        if p is None:
            return  # late reply to a failed call
        p.peer.pending.discard(rid)
        if p.fut.done():
            return
        try:
            value = _wire.decode(payload, bufs)
        except Exception as e:
            p.fut.set_exception(e)
            return
        if status == R_OK:
            p.fut.set_result(value)
        elif status == R_ERROR:
            actor, rank, method, exc, tb = value
            p.fut.set_exception(ActorError(actor, rank, method, exc, tb))
        else:
            p.fut.set_exception(SupervisionError(value))

    def _drain_monitor(self, peer: _Peer) -> None:
        mon = peer.monitor
        if mon is None or mon.closed:
            return
        while True:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                return
            event = int.from_bytes(frames[0][:2], "little")
            if event == zmq.EVENT_DISCONNECTED and peer.addr not in self._dead:
                if any(o.ref.addr == peer.addr for o in self._owned.values()):
                    continue  # our own child: pidfd / heartbeats give the precise reason
                self.mark_dead(
                    peer.addr,
                    MeshFailure("?", "?", -1, "connection", f"at {peer.addr}: connection lost (the process exited or its host is unreachable)"),
                )

    def mark_dead(self, addr: str, failure: MeshFailure) -> None:
        """Fail every call in flight to ``addr`` and every later one."""
        self._dead.setdefault(addr, failure)
        peer = self._peers.get(addr)
        if peer is None:
            return
        for rid in list(peer.pending):
            p = self._pending.pop(rid, None)
            if p is not None and not p.fut.done():
                p.fut.set_exception(SupervisionError(failure))
        peer.pending.clear()

    # ---- inbox: calls, spawns, events -------------------------------------------------------

    def _drain_inbox(self) -> None:
        sock = self._inbox
        if sock is None or sock.closed:
            return
        while True:
            try:
                frames = _recv_frames(sock, 1)
            except zmq.ZMQError:  # Again: drained
                return
            msg = self._verify(frames, 1)
            if msg is None:
                continue
            header, bufs = msg
            ident = frames[0]
            try:
                self._dispatch(ident, header, bufs)
            except Exception as e:
                self.stats["dropped_malformed"] += 1
                traceback.print_exc()
                if header[0] == K_CALL and len(header) > 5 and header[5]:  # a caller waits: tell it
                    self.reply(ident, header[1], R_ERROR, [header[2], -1, header[3], e, traceback.format_exc()])

    def _dispatch(self, ident: bytes, header: list, bufs: list) -> None:
        kind = header[0]
        if kind == K_CALL:
            _, rid, actor, method, mrank, want_reply, payload, shm = header
            if shm:
                try:
                    bufs = self._from_shm(bufs, shm)
                except Exception as e:
                    if want_reply:
                        self.reply(ident, rid, R_ERROR, [actor, -1, method, e, ""])
                    return
            if payload is None:
                payload, bufs = _payload_of(bufs)
            host = self._actors.get(actor)
            if host is None:
                failed = self._failed_spawns.get(actor)
                if failed is not None:
                    if want_reply:
                        self.reply(ident, rid, R_DEAD, failed)
                    return
                if want_reply:
                    exc = LookupError(f"no actor named {actor!r} in process {self.proc_id!r}")
                    self.reply(ident, rid, R_ERROR, [actor, -1, method, exc, ""])
                return
            host.deliver(("call", ident, rid, method, mrank, want_reply, payload, bufs))
        elif kind == K_SPAWN:
            self._on_spawn(ident, header)
        elif kind == K_STOP:
            self.loop.create_task(self._on_stop(ident, header[1]))
        elif kind == K_AUTH:  # a verified hello: ack its nonce (signed, so it proves our secret)
            _, rid, nonce = header
            self.stats["auth_handshakes"] += 1
            self.reply(ident, rid, R_OK, nonce)
        elif kind == K_HELLO:
            _, proc_id, addr, pid, host = header
            o = self._owned.get(proc_id)
            if o is not None and not o.hello.done():
                o.ref.pid, o.ref.host, o.ref.addr = pid, host, addr
                o.hello.set_result(None)
        elif kind == K_EVENT:
            _, owner_actor, payload = header
            failure = _wire.decode(payload, bufs)
            self.on_failure_event(owner_actor, failure)
        else:
            self.stats["dropped_malformed"] += 1

    def reply(self, ident: bytes, rid: int, status: int, value: Any, who: tuple = ("", -1, "")) -> None:
        """Reply to a call; ``who`` (actor, rank, method) names the replier in errors."""
        try:
            payload, buffers = _wire.encode(value)
        except Exception as e:  # e.g. the endpoint returned an unregistered type
            status = R_ERROR
            err = TypeError(f"could not send the return value of {who[2]!r}: {e}")
            payload, buffers = _wire.encode([who[0], who[1], who[2], err, ""])
        if self._inbox is None or self._inbox.closed:
            return
        if len(payload) > _INLINE_PAYLOAD:
            buffers = [payload, *buffers]
            payload = None
        try:
            buffers, shm = self._to_shm(buffers, self._inbox_local)
            self._send(self._inbox, [ident], _packb([K_REPLY, rid, status, payload, shm]), buffers)
        except zmq.ZMQError:
            self.stats["reply_unroutable"] += 1  # the caller went away

    # ---- hosting actors -----------------------------------------------------------------

    def _on_spawn(self, ident: bytes, header: list) -> None:
        _, rid, name, cls_path, payload, point, mesh_name, owner_addr, owner_actor = header
        try:
            if name in self._actors:
                raise ValueError(f"an actor named {name!r} already exists in process {self.proc_id!r}")
            cls = _import_class(cls_path)
            endpoints_of(cls)  # re-check on this side
            args, kwargs = _wire.decode(payload, [])
        except Exception as e:
            tb = traceback.format_exc()
            self.reply(ident, rid, R_ERROR, [name, point[0], "__init__", e, tb])
            failure = MeshFailure(
                mesh_name, self.proc_id, point[0], "actor", f"could not be spawned: {type(e).__name__}: {e}",
                os.getpid(), _hostname(), actor=name, detail=tb, addr=self.address or "",
            )
            self._failed_spawns[name] = failure
            payload, bufs = _wire.encode(failure)
            self.send_to(owner_addr, [K_EVENT, owner_actor, payload], bufs)
            return
        pt = Point(point[0], point[1], point[2])
        host = _ActorHost(self, name, cls, args, kwargs, pt, mesh_name, owner_addr, owner_actor)
        self._actors[name] = host
        host.start(ident, rid)

    async def _on_stop(self, ident: bytes, rid: int) -> None:
        """Graceful stop of this worker: actors' __cleanup__, owned meshes, then exit."""
        for host in list(self._actors.values()):
            await host.stop()
        await self.shutdown()
        # The inbox is closed now: reply through a fresh socket to the same peer is not
        # possible, so the caller learns of the stop from this process's exit instead.
        if not self.stopped.done():
            self.stopped.set_result(None)

    def on_failure_event(self, owner_actor: str, failure: MeshFailure) -> None:
        """A failure reported by another process (a failed actor, or a process that a node
        agent watched for us): fail what we have in flight there, then supervise."""
        if failure.addr and failure.kind != "actor":
            self.mark_dead(failure.addr, failure)
        self.deliver_failure(owner_actor, failure)

    def deliver_failure(self, owner_actor: str, failure: MeshFailure) -> None:
        """Hand a failure to the owning actor's __supervise__, or to the fault hook at the root."""
        host = self._actors.get(owner_actor) if owner_actor else None
        if host is None:
            _fault_hook(failure)
            return
        host.deliver(("supervise", failure))

    # ---- owning processes -----------------------------------------------------------------

    def spawn_local(
        self, mesh: str, count: int, envs: list[dict[str, str]], owner_actor: str
    ) -> list[_Owned]:
        """Start ``count`` worker processes on this host; they are owned by this runtime."""
        if _importing_main:
            raise RuntimeError(
                "a worker re-imported your main script to find an actor class, and the script "
                "spawned processes at import time; put the script's top-level code under "
                "'if __name__ == \"__main__\":'"
            )
        self.ensure_inbox()
        self.ensure_monitor()
        seq = next(self._mesh_seq)
        out = []
        for i in range(count):
            proc_id = f"{mesh}-{seq}.{i}" if self.proc_id.startswith("root") else f"{self.proc_id}/{mesh}-{seq}.{i}"
            # Same-host spawns use ipc; a tcp-listening runtime gives its workers tcp inboxes
            # (port chosen by the worker, learned from its hello).
            tcp = self.address.startswith("tcp://")
            addr = f"tcp://{_hostname()}:0" if tcp else f"ipc://{self._ipc_dir()}/p{seq}.{i}"
            env = dict(os.environ)
            env.update(envs[i])
            env.update(
                RELAY_PROC_ID=proc_id,
                RELAY_BIND=addr,
                RELAY_PARENT_ADDR=self.address,
                RELAY_PARENT_HB=self._hb.address,
                RELAY_PARENT_PID=str(os.getpid()),
                RELAY_SYS_PATH=os.pathsep.join(p for p in sys.path if p),
                RELAY_MAIN_FILE=getattr(sys.modules.get("__main__"), "__file__", "") or "",
            )
            popen = subprocess.Popen(
                [sys.executable, "-m", "relay._worker"], env=env, stdin=subprocess.DEVNULL, close_fds=True
            )
            ref = ProcRef(proc_id, addr, mesh, i, _hostname(), popen.pid)
            o = _Owned(ref, popen, owner_actor, self.loop.create_future(), self.loop.create_future())
            self._owned[proc_id] = o
            self._hb.watch(proc_id)
            try:
                o.pidfd = os.pidfd_open(popen.pid)
                self.loop.add_reader(o.pidfd, self._on_exit, proc_id)
            except (AttributeError, OSError):
                self.loop.create_task(self._poll_exit(proc_id))
            out.append(o)
        return out

    async def _poll_exit(self, proc_id: str) -> None:
        o = self._owned[proc_id]
        while o.popen.poll() is None and not self._closed:
            await asyncio.sleep(0.05)
        self._on_exit(proc_id)

    def _on_exit(self, proc_id: str) -> None:
        o = self._owned.get(proc_id)
        if o is None or o.exited.done():
            return
        code = o.popen.poll()
        if code is None:
            return
        if o.pidfd >= 0:
            self._remove_reader(o.pidfd)
            os.close(o.pidfd)
            o.pidfd = -1
        if self._hb is not None:
            self._hb.unwatch(proc_id)
        o.exited.set_result(code)
        if o.stopping:
            self.mark_dead(o.ref.addr, _failure_stopped(o.ref.addr, "stopped", o.ref))
            return
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            failure = _failure(o.ref, "signal", f"was killed by signal {name}")
        else:
            failure = _failure(o.ref, "exit", f"exited with code {code}")
        self._proc_failed(o, failure)

    def _heartbeat_lost_threadsafe(self, proc_id: str, why: str) -> None:
        try:
            self.loop.call_soon_threadsafe(self._heartbeat_lost, proc_id, why)
        except RuntimeError:
            pass  # loop closed

    def ensure_monitor(self) -> str:
        """Start the heartbeat monitor (once); return the address processes beat to."""
        if self._hb is None:
            self._hb = HeartbeatMonitor(self.ctx, self._monitor_address(), self._heartbeat_lost_threadsafe)
            self._hb.start()
        return self._hb.address

    def _monitor_address(self) -> str:
        if os.environ.get("RELAY_LISTEN") == "tcp":
            import socket as _socket

            with _socket.socket() as s:  # a free port on this host's address
                s.bind((_hostname(), 0))
                port = s.getsockname()[1]
            return f"tcp://{_hostname()}:{port}"
        return f"ipc://{self._ipc_dir()}/hb"

    def watch_remote(self, ref: ProcRef, owner_actor: str = "") -> None:
        """Supervise a process this runtime did not spawn (e.g. a node agent started by
        torchrun) through its heartbeats: silence for the timeout is a failure."""
        self.ensure_monitor()
        self._remote[ref.proc_id] = (ref, owner_actor)
        self._hb.watch(ref.proc_id, grace=STARTUP_GRACE / 4)  # it is running already

    def unwatch_remote(self, proc_id: str) -> None:
        if self._remote.pop(proc_id, None) is not None and self._hb is not None:
            self._hb.unwatch(proc_id)

    def _heartbeat_lost(self, proc_id: str, why: str) -> None:
        remote = self._remote.pop(proc_id, None)
        if remote is not None:
            ref, owner_actor = remote
            failure = _failure(ref, "heartbeat", why)
            self.mark_dead(ref.addr, failure)
            self.deliver_failure(owner_actor, failure)
            return
        o = self._owned.get(proc_id)
        if o is None or o.exited.done() or o.stopping:
            return
        o.stopping = True  # its exit (we kill it below) is not a second failure
        failure = _failure(o.ref, "heartbeat", f"{why}; killed it")
        try:
            o.popen.kill()
        except ProcessLookupError:
            pass
        self._proc_failed(o, failure)

    def _proc_failed(self, o: _Owned, failure: MeshFailure) -> None:
        if not o.hello.done():
            o.hello.set_exception(SupervisionError(failure))
            o.hello.exception()  # retrieved: a failed start is reported through supervision
        self.mark_dead(o.ref.addr, failure)
        self.deliver_failure(o.owner_actor, failure)

    async def stop_procs(self, refs: list[ProcRef], timeout: float) -> None:
        """Stop owned processes: ask them to stop, then SIGKILL what is left after ``timeout``."""
        owned = [self._owned[r.proc_id] for r in refs if r.proc_id in self._owned]
        for o in owned:
            o.stopping = True
            if not o.exited.done() and o.hello.done() and o.hello.exception() is None:
                peer = self.peer(o.ref.addr)
                self._send(peer.sock, [], _packb([K_STOP, next(self._ids)]), [], peer)
            elif not o.exited.done():
                o.popen.terminate()
        waits = [o.exited for o in owned if not o.exited.done()]
        if waits:
            done, left = await asyncio.wait(waits, timeout=timeout)
            if left:
                for o in owned:
                    if not o.exited.done():
                        o.popen.kill()
                await asyncio.wait(left, timeout=5)
        for o in owned:
            self.mark_dead(o.ref.addr, _failure_stopped(o.ref.addr, "stopped", o.ref))


# ------------------------------------------------------------------------------------------


def _failure(ref: ProcRef, kind: str, reason: str) -> MeshFailure:
    return MeshFailure(ref.mesh, ref.proc_id, ref.rank, kind, reason, ref.pid, ref.host, addr=ref.addr)


def _failure_stopped(addr: str, why: str, ref: ProcRef | None = None) -> MeshFailure:
    if ref is None:
        return MeshFailure("?", addr, -1, "stopped", why)
    return _failure(ref, "stopped", f"was {why}" if why == "stopped" else why)


_importing_main = False


def _import_main() -> Any:
    """The spawner's __main__ script, imported as __mp_main__ (as multiprocessing does: its
    ``if __name__ == "__main__":`` block does not run)."""
    global _importing_main
    mod = sys.modules.get("__mp_main__")
    if mod is not None:
        return mod
    path = os.environ.get("RELAY_MAIN_FILE", "")
    if not path.endswith(".py") or not os.path.exists(path):
        raise ImportError("the actor class is defined in __main__, which is not a file this process can import")
    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = mod
    _importing_main = True
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop("__mp_main__", None)
        raise
    finally:
        _importing_main = False
    return mod


def _import_class(path: str) -> type:
    module, _, qual = path.partition(":")
    mod = _import_main() if module in ("__main__", "__mp_main__") else importlib.import_module(module)
    obj: Any = mod
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


class _ActorHost:
    """One actor in this process: its mailbox and the loop that handles it serially."""

    def __init__(self, rt: Runtime, name, cls, args, kwargs, point: Point, mesh, owner_addr, owner_actor):
        self.rt = rt
        self.name = name
        self.proc_id = rt.proc_id
        self.cls = cls
        self.point = point
        self.mesh = mesh
        self.owner_addr = owner_addr
        self.owner_actor = owner_actor
        self.specs = endpoints_of(cls)
        self.is_async = any(s.is_async for s in self.specs.values()) or not self.specs
        self.instance: Any = None
        self.failed: MeshFailure | None = None
        self.mailbox: asyncio.Queue = asyncio.Queue()
        self.executor = None if self.is_async else concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"actor-{name}")
        self._args, self._kwargs = args, kwargs
        self._task: asyncio.Task | None = None

    def start(self, ident: bytes, rid: int) -> None:
        ctx = contextvars.copy_context()
        ctx.run(_current.set, self)
        ctx.run(_rt_var.set, self.rt)
        self._task = self.rt.loop.create_task(self._run(ident, rid), context=ctx)

    def deliver(self, item: tuple) -> None:
        if self.failed is not None and item[0] == "call":
            _, ident, rid, method, _, want_reply, _, _ = item
            if want_reply:
                self.rt.reply(ident, rid, R_DEAD, self.failed)
            return
        self.mailbox.put_nowait(item)

    async def _invoke(self, fn, *args, **kwargs):
        if self.executor is None:
            result = fn(*args, **kwargs)
            if asyncio.iscoroutine(result):
                result = await result
            return result
        ctx = contextvars.copy_context()
        return await self.rt.loop.run_in_executor(self.executor, functools.partial(ctx.run, fn, *args, **kwargs))

    async def _run(self, ident: bytes, rid: int) -> None:
        try:
            self.instance = await self._invoke(self.cls, *self._args, **self._kwargs)
            setup = getattr(self.instance, "setup", None)
            if callable(setup):
                await self._invoke(setup)
        except BaseException as e:
            tb = traceback.format_exc()
            self.rt.reply(ident, rid, R_ERROR, [self.name, self.point.rank, "__init__", e, tb])
            self.fail("failed in __init__/setup", tb)
            return
        self.rt.reply(ident, rid, R_OK, None)
        while True:
            item = await self.mailbox.get()
            kind = item[0]
            if kind == "call":
                spec = self.specs.get(item[3])
                if spec is not None and spec.concurrent:
                    token = _message_rank.set(item[4])
                    self.rt.loop.create_task(self._handle(item))
                    _message_rank.reset(token)
                else:
                    await self._handle(item)
            elif kind == "supervise":
                await self._supervise(item[1])
            elif kind == "stop":
                item[1].set_result(None)
                return
            if self.failed is not None:
                return

    async def _handle(self, item: tuple) -> None:
        _, ident, rid, method, mrank, want_reply, payload, bufs = item
        _message_rank.set(mrank)
        try:
            if method not in self.specs:
                raise AttributeError(f"actor {self.name!r} ({self.cls.__qualname__}) has no endpoint {method!r}")
            args, kwargs = _wire.decode(payload, bufs)
            result = await self._invoke(getattr(self.instance, method), *args, **kwargs)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            sys.stderr.write(f"relay: endpoint {method!r} of actor {self.name!r} called exit({code})\n")
            sys.stderr.flush()
            os._exit(code)
        except BaseException as e:
            tb = traceback.format_exc()
            if isinstance(e, asyncio.CancelledError) and self.failed is not None:
                return
            if want_reply and isinstance(e, Exception):
                self.rt.reply(ident, rid, R_ERROR, [self.name, self.point.rank, method, e, tb])
            else:
                # No one to tell (broadcast) or not an Exception: the actor dies (Monarch semantics).
                if want_reply:
                    self.rt.reply(ident, rid, R_ERROR, [self.name, self.point.rank, method, e, tb])
                self.fail(f"failed: endpoint {method!r} raised {type(e).__name__}: {e}", tb)
            return
        if want_reply:
            self.rt.reply(ident, rid, R_OK, result, (self.name, self.point.rank, method))

    async def _supervise(self, failure: MeshFailure) -> None:
        hook = getattr(self.instance, "__supervise__", None)
        handled = False
        detail = ""
        if callable(hook):
            try:
                handled = bool(await self._invoke(hook, failure))
            except BaseException as e:
                detail = f"__supervise__ raised {type(e).__name__}: {e}\n{traceback.format_exc()}"
        if not handled:
            self.fail("failed: a mesh it owns failed and __supervise__ did not handle it", detail, [str(failure)])

    def fail(self, reason: str, detail: str = "", cause: list | None = None) -> None:
        if self.failed is not None:
            return
        self.failed = MeshFailure(
            self.mesh, self.proc_id, self.point.rank, "actor", reason, os.getpid(), _hostname(),
            actor=self.name, detail=detail, cause=cause or [], addr=self.rt.address or "",
        )
        while not self.mailbox.empty():
            item = self.mailbox.get_nowait()
            if item[0] == "call" and item[5]:
                self.rt.reply(item[1], item[2], R_DEAD, self.failed)
            elif item[0] == "stop":
                item[1].set_result(None)
        try:
            payload, bufs = _wire.encode(self.failed)
            self.rt.send_to(self.owner_addr, [K_EVENT, self.owner_actor, payload], bufs)
        except Exception:
            traceback.print_exc()

    async def stop(self, timeout: float = 10.0) -> None:
        if self.failed is None and self._task is not None and not self._task.done():
            done = self.rt.loop.create_future()
            self.mailbox.put_nowait(("stop", done))
            try:
                await asyncio.wait_for(done, timeout)
            except asyncio.TimeoutError:
                self._task.cancel()
            cleanup = getattr(self.instance, "__cleanup__", None)
            if callable(cleanup):
                try:
                    await asyncio.wait_for(self._invoke(cleanup, None), timeout)
                except BaseException:
                    traceback.print_exc()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------------
# Which runtime serves the caller


_rt_var: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("relay_runtime", default=None)
_runtimes: dict[asyncio.AbstractEventLoop, Runtime] = {}
_sync_loop: asyncio.AbstractEventLoop | None = None


def current_runtime() -> Runtime:
    """The runtime of the calling actor, else of the running loop, else of a private loop
    used by blocking ``.get()`` calls made outside any event loop."""
    rt = _rt_var.get()
    if rt is not None and not rt._closed:
        return rt
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        global _sync_loop
        if _sync_loop is None or _sync_loop.is_closed():
            _sync_loop = asyncio.new_event_loop()
        loop = _sync_loop
    rt = _runtimes.get(loop)
    if rt is None:
        rt = Runtime(loop)
        _runtimes[loop] = rt
    return rt


def install_runtime(rt: Runtime) -> None:
    _runtimes[rt.loop] = rt
    _rt_var.set(rt)


@atexit.register
def _kill_owned_at_exit() -> None:
    for rt in list(_runtimes.values()):
        rt.kill_all()
        if rt._tmpdir:
            shutil.rmtree(rt._tmpdir, ignore_errors=True)
        if rt._owns_shm:
            _shm.remove_job_dir()

