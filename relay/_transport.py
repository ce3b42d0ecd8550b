"""Transport of one runtime: its inbox, its peers, frames, MACs and shared-memory buffers.

Wire (all frames after the ROUTER identity): ``[mac || header, *buffers]`` for a header of
up to ``_SMALL_HEADER`` bytes, else ``[mac, header, *buffers]``; the header is a message of
relay/_messages.py. Invariants:

- ORDER: one DEALER per (this process, peer inbox) pair, so messages from one sender to one
  process arrive in send order (per-sender FIFO); an actor's mailbox preserves it.
- AUTH: every frame set is verified (relay/_auth.py) before it is decoded; failures are
  dropped, counted in ``stats`` and logged at most once per ``RELAY_AUTH_LOG_INTERVAL``
  seconds. The one answer an unauthenticated sender can get is the constant AUTH_REJECTED,
  and only to a hello (``AuthHello``), at most ``REJECT_BURST`` at once and ``REJECT_RATE``
  per second.

What arrives is handed to the runtime's handlers: messages on the inbox (``on_inbox``),
replies on a peer's socket (``on_reply``), a peer's AUTH_REJECTED (``on_rejected``) and a
lost connection to a peer (``on_disconnect``).
"""

from __future__ import annotations

import asyncio
import collections
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from . import _messages, _shm, _wire
from ._auth import AUTH_REJECTED, MAC_SIZE, Signer, TokenBucket
from ._messages import HELLO_MAX, HELLO_PREFIX, Message, Reply
from ._settings import Settings

REJECT_RATE, REJECT_BURST = 1.0, 10  # AUTH_REJECTED replies: per second, at once
_SMALL_HEADER = 4096  # headers up to this size share a frame with their MAC
# Encoded arguments/results up to this size ride inside the (fully MAC'd) header; larger
# ones travel as the first buffer frame (the MAC covers their size; see relay/_auth.py).
INLINE_PAYLOAD = 64 * 1024
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)
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


def take_payload(payload: Any, bufs: list, shm: list | None) -> tuple[Any, list]:
    """The encoded payload and buffers of a received message: shared-memory buffers mapped
    (relay/_shm.py), and a payload that travelled as the first buffer frame taken out."""
    if shm:
        bufs = list(bufs)
        try:
            for i, name, size in shm:
                bufs[i] = _shm.take(name, size)
        except BaseException:
            _shm.release([entry[1] for entry in shm])
            raise
    if payload is None:
        if not bufs:
            raise ValueError("message announces a payload frame but has none")
        return _wire.buffer_of(bufs[0]), bufs[1:]
    return payload, bufs


def remove_reader(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    if not loop.is_closed():
        try:
            loop.remove_reader(fd)
        except Exception:
            pass


@dataclass
class Peer:
    """Our DEALER to another process's inbox, and its connection monitor."""

    addr: str
    sock: zmq.Socket
    monitor: zmq.Socket | None
    local: bool = False  # same host: large buffers may go through shared memory


class Transport:
    """The sockets of one runtime. Handlers run on the runtime's loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        proc_id: str,
        cfg: Settings,
        bind: str | None,
        on_inbox: Callable[[bytes, Message, list], None],
        on_reply: Callable[[Reply, list], None],
        on_rejected: Callable[[str], None],
        on_disconnect: Callable[[str], None],
    ):
        self.loop = loop
        self.proc_id = proc_id
        self.ctx = zmq.Context.instance()
        self.signer = Signer()
        self.stats: collections.Counter = collections.Counter()
        self.address: str | None = None
        self.closed = False
        self._cfg = cfg
        self._bind = bind
        self._handlers = (on_inbox, on_reply, on_rejected, on_disconnect)
        self._inbox: zmq.Socket | None = None
        self._inbox_local = False
        self._peers: dict[str, Peer] = {}
        self._monitors: dict[int, Peer] = {}
        self._tmpdir: str | None = None
        self._shm_min = cfg.shm_min_bytes if _shm.enabled() else 0
        self._rejects = TokenBucket(REJECT_RATE, REJECT_BURST)
        self._unauth_unlogged = 0  # dropped since the last log line
        self._unauth_log_at = 0.0  # monotonic time before which no line is written
        self._unauth_log_handle: asyncio.TimerHandle | None = None

    @property
    def uses_shm(self) -> bool:
        return bool(self._shm_min)

    def ipc_dir(self) -> str:
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="relay-", dir=self._cfg.ipc_dir)
        return self._tmpdir

    def remove_ipc_dir(self) -> None:
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def ensure_inbox(self) -> str:
        if self._inbox is None:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # RELAY_LISTEN=tcp makes a root reachable from other hosts (node agents do this);
            # its workers then listen on tcp too (see relay/_processes.py).
            host = self._cfg.host
            bind = self._bind or (f"tcp://{host}:0" if self._cfg.listen_tcp else f"ipc://{self.ipc_dir()}/inbox")
            sock.bind(bind)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.address.startswith("tcp://0.0.0.0:"):
                self.address = self.address.replace("0.0.0.0", host)
            self._inbox = sock
            self._inbox_local = self.address.startswith("ipc://")
            self.loop.add_reader(sock.getsockopt(zmq.FD), self._drain_inbox)
            self.loop.call_soon(self._drain_inbox)
        return self.address

    def peer(self, addr: str) -> Peer:
        peer = self._peers.get(addr)
        if peer is None:
            if self.closed:
                raise RuntimeError("relay runtime is closed (its event loop ended)")
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(addr)
            peer = Peer(addr, sock, monitor, local=addr.startswith("ipc://"))
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

    # ---- sending ----------------------------------------------------------------------------

    def pack_payload(self, payload: bytes, buffers: list, local: bool) -> tuple[bytes | None, list, list | None]:
        """Where an encoded payload and its buffers travel: a large payload as the first
        buffer frame (payload None), large buffers to a same-host peer in shared memory
        (their entries returned as ``shm``, to put in the header)."""
        if len(payload) > INLINE_PAYLOAD:
            buffers = [payload, *buffers]
            payload = None
        if not local or not buffers or not self._shm_min:
            return payload, buffers, None
        out, shm = None, None
        for i, b in enumerate(buffers):
            n = b.nbytes if hasattr(b, "nbytes") else len(b)
            if n >= self._shm_min:
                if out is None:
                    out, shm = list(buffers), []
                shm.append([i, _shm.write(b), n])
                out[i] = b""
                self.stats["shm_buffers_sent"] += 1
        return (payload, out, shm) if out is not None else (payload, buffers, None)

    def send(self, peer: Peer, msg: Message, buffers: list = ()) -> None:
        """Send ``msg`` to the inbox of ``peer``."""
        self._send(peer.sock, [], _messages.encode(msg), list(buffers), peer)

    def send_reply(self, ident: bytes, rid: int, status: int, payload: bytes, buffers: list) -> None:
        """Answer the sender ``ident`` of a message on our inbox (gone: counted, dropped)."""
        if self._inbox is None or self._inbox.closed:
            return
        try:
            payload, buffers, shm = self.pack_payload(payload, buffers, self._inbox_local)
            self._send(self._inbox, [ident], _messages.encode(Reply(rid, status, payload, shm)), buffers)
        except zmq.ZMQError:
            self.stats["reply_unroutable"] += 1  # the caller went away

    def _send(self, sock: zmq.Socket, prefix: list, header: bytes, buffers: list, peer: Peer | None = None) -> None:
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

    # ---- receiving --------------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        sock = self._inbox
        if sock is None or sock.closed:
            return
        on_inbox = self._handlers[0]
        while True:
            try:
                frames = _recv_frames(sock, 1)
            except zmq.ZMQError:  # Again: drained
                return
            got = self._verify(frames, 1)
            if got is not None:
                msg, bufs = got
                on_inbox(frames[0], msg, bufs)

    def _drain_peer(self, peer: Peer) -> None:
        sock = peer.sock
        if sock.closed:
            return
        while True:
            try:
                frames = _recv_frames(sock, 0)
            except zmq.ZMQError:  # Again: drained
                return
            if len(frames) == 1 and frames[0] == AUTH_REJECTED:
                self._handlers[2](peer.addr)
                continue
            got = self._verify(frames, 0)
            if got is None:
                continue
            msg, bufs = got
            if type(msg) is Reply:
                self._handlers[1](msg, bufs)
            else:
                self.stats["dropped_malformed"] += 1

    def _drain_monitor(self, peer: Peer) -> None:
        mon = peer.monitor
        if mon is None or mon.closed:
            return
        while True:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                return
            if int.from_bytes(frames[0][:2], "little") == zmq.EVENT_DISCONNECTED:
                self._handlers[3](peer.addr)

    def _verify(self, frames: list, skip: int) -> tuple[Message, list] | None:
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
            self.count_unauthenticated()
            if skip == 1 and not bufs and len(hbuf) <= HELLO_MAX and hbuf[:2] == HELLO_PREFIX:
                self._reject_hello(frames[0])
            return None
        try:
            return _messages.decode(hbuf), bufs
        except ValueError:
            self.stats["dropped_malformed"] += 1
            return None

    # ---- unauthenticated senders ------------------------------------------------------------

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

    def count_unauthenticated(self) -> None:
        """Count a dropped unauthenticated message; log the count at most once per interval."""
        self.stats["dropped_unauthenticated"] += 1
        self._unauth_unlogged += 1
        if self._unauth_log_handle is None and not self.closed and not self.loop.is_closed():
            delay = max(0.0, self._unauth_log_at - time.monotonic())
            self._unauth_log_handle = self.loop.call_later(delay, self._log_unauthenticated)

    def _log_unauthenticated(self) -> None:
        self._unauth_log_handle = None
        n, self._unauth_unlogged = self._unauth_unlogged, 0
        interval = self._cfg.auth_log_interval
        self._unauth_log_at = time.monotonic() + interval
        sys.stderr.write(
            f"relay: process {self.proc_id!r} (pid {os.getpid()}, {self.address or 'no inbox'}) dropped {n} "
            f"unauthenticated message(s) (total {self.stats['dropped_unauthenticated']}): a peer without "
            f"this job's secret (RELAY_JOB_SECRET) is sending to it; at most one such line per "
            f"{interval:g} s\n"
        )
        sys.stderr.flush()

    # ---- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._unauth_log_handle is not None:
            self._unauth_log_handle.cancel()
            self._unauth_log_handle = None
            if self._unauth_unlogged:
                self._log_unauthenticated()
        for fd in list(self._monitors):
            remove_reader(self.loop, fd)
        self._monitors.clear()
        for peer in self._peers.values():
            remove_reader(self.loop, peer.sock.getsockopt(zmq.FD))
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
            remove_reader(self.loop, self._inbox.getsockopt(zmq.FD))
            self._inbox.close(0)
