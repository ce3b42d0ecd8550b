"""The call table of one runtime: calls in flight and their replies, calls that arrive for
the actors of this process, and the authentication handshake.

NO-HANG: every call in flight is failed with SupervisionError when its target process is
known dead (pidfd exit, missed heartbeats, lost connection, owner event) or stopped
(``mark_dead``), and so is every later call to it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import traceback
from typing import Any

from . import _wire
from ._auth import secret_advice, secret_origin
from ._errors import ActorError, AuthenticationError, MeshFailure, SupervisionError
from ._host import Actors, Incoming
from ._messages import R_DEAD, R_ERROR, R_OK, AuthHello, Call, Reply, Spawn
from ._transport import Transport, take_payload

AUTH_TIMEOUT = 5.0  # seconds a handshake waits for its ack
_AUTH = "<auth>"  # the method name of a pending handshake


class _Pending:
    __slots__ = ("fut", "addr", "actor", "method")

    def __init__(self, fut: asyncio.Future, addr: str, actor: str, method: str):
        self.fut = fut
        self.addr = addr
        self.actor = actor
        self.method = method


def _no_ack_message(addr: str, timeout: float) -> str:
    nothing = ""
    if addr.startswith("ipc://") and not os.path.exists(addr[len("ipc://"):]):
        nothing = f" (nothing listens there: no socket file {addr[len('ipc://'):]})"
    return (
        f"no authenticated answer from the relay process at {addr} within {timeout:g} s{nothing}: "
        f"either no relay process runs there, or it does not share this process's secret "
        f"({secret_origin()}). {secret_advice()}."
    )


class CallTable:
    """Calls this process made (by request id) and calls it answers."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: Transport, actors: Actors, proc_id: str):
        self._loop = loop
        self._transport = transport
        self._actors = actors
        self._proc_id = proc_id
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._by_addr: dict[str, set[int]] = {}  # peer inbox -> its calls in flight
        self.dead: dict[str, MeshFailure] = {}  # inbox addr -> why it is dead
        self.peers: dict[str, Any] = {}  # inbox addr -> the ProcRef last called there (names it if it dies)

    def next_id(self) -> int:
        return next(self._ids)

    def _expect(self, addr: str, actor: str, method: str) -> tuple[int, asyncio.Future]:
        rid = next(self._ids)
        fut = self._loop.create_future()
        self._pending[rid] = _Pending(fut, addr, actor, method)
        self._by_addr.setdefault(addr, set()).add(rid)
        return rid, fut

    def _failed(self, failure: MeshFailure) -> asyncio.Future:
        fut = self._loop.create_future()
        fut.set_exception(SupervisionError(failure))
        return fut

    # ---- calls out ----------------------------------------------------------------------

    def call(
        self, ref: Any, actor: str, method: str, mrank: int, payload: bytes, buffers: list, want_reply: bool
    ) -> asyncio.Future | None:
        """Send one call to the process of ``ref`` (a ProcRef); return the future of its
        reply (None for fire-and-forget)."""
        dead = self.dead.get(ref.addr)
        if dead is not None:
            return self._failed(dead) if want_reply else None
        if ref.addr not in self.peers:
            self.peers[ref.addr] = ref
        peer = self._transport.peer(ref.addr)
        payload, buffers, shm = self._transport.pack_payload(payload, buffers, peer.local)
        fut = None
        if want_reply:
            rid, fut = self._expect(ref.addr, actor, method)
        else:
            rid = next(self._ids)
        self._transport.send(peer, Call(rid, actor, method, mrank, want_reply, payload, shm), buffers)
        return fut

    def request(self, addr: str, msg: Spawn) -> asyncio.Future:
        """A control request that expects a reply (its ``rid`` is assigned here)."""
        dead = self.dead.get(addr)
        if dead is not None:
            return self._failed(dead)
        peer = self._transport.peer(addr)
        rid, fut = self._expect(addr, msg.name, "<control>")
        self._transport.send(peer, msg._replace(rid=rid))
        return fut

    async def authenticate(self, addr: str, timeout: float = AUTH_TIMEOUT) -> None:
        """Prove that the process at ``addr`` shares this job's secret: send a signed hello
        and wait for its signed ack of a fresh nonce. Raises AuthenticationError when the
        peer rejects the hello (it has another secret) or no ack comes within ``timeout``;
        SupervisionError when the peer is known dead."""
        dead = self.dead.get(addr)
        if dead is not None:
            raise SupervisionError(dead)
        peer = self._transport.peer(addr)
        rid, fut = self._expect(addr, "", _AUTH)
        nonce = secrets.token_hex(16)
        self._transport.send(peer, AuthHello(rid, nonce))
        try:
            echoed = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            self._forget(rid)
            raise AuthenticationError(addr, _no_ack_message(addr, timeout)) from None
        if echoed != nonce:  # a signed ack of another hello: a replay
            why = f"the process at {addr} answered the authentication handshake with a wrong nonce"
            raise AuthenticationError(addr, why)

    def on_rejected(self, addr: str) -> None:
        """The peer rejected our hello (AUTH_REJECTED): fail the handshakes waiting on it."""
        waiting = [rid for rid in self._by_addr.get(addr, ()) if self._pending[rid].method == _AUTH]
        if not waiting:
            self._transport.count_unauthenticated()  # unsolicited: dropped like any unsigned message
            return
        err = AuthenticationError(
            addr,
            f"the relay process at {addr} rejected this process: not authenticated, its secret "
            f"differs from the server's ({secret_origin()}). {secret_advice()}.",
        )
        for rid in waiting:
            self.fail(rid, err)

    # ---- replies in ---------------------------------------------------------------------

    def _forget(self, rid: int) -> _Pending | None:
        p = self._pending.pop(rid, None)
        if p is not None:
            self._by_addr.get(p.addr, set()).discard(rid)
        return p

    def fail(self, rid: int, exc: BaseException) -> None:
        p = self._forget(rid)
        if p is not None and not p.fut.done():
            p.fut.set_exception(exc)

    def on_reply(self, msg: Reply, bufs: list) -> None:
        try:
            payload, bufs = take_payload(msg.payload, bufs, msg.shm)
        except Exception as e:
            self.fail(msg.rid, e)
            return
        p = self._forget(msg.rid)
        if p is None or p.fut.done():
            return  # late reply to a failed call
        try:
            value = _wire.decode(payload, bufs)
        except Exception as e:
            p.fut.set_exception(e)
            return
        if msg.status == R_OK:
            p.fut.set_result(value)
        elif msg.status == R_ERROR:
            actor, rank, method, exc, tb = value
            p.fut.set_exception(ActorError(actor, rank, method, exc, tb))
        else:
            p.fut.set_exception(SupervisionError(value))

    def mark_dead(self, addr: str, failure: MeshFailure) -> None:
        """Fail every call in flight to ``addr`` and every later one."""
        self.dead.setdefault(addr, failure)
        for rid in list(self._by_addr.pop(addr, ())):
            p = self._pending.pop(rid, None)
            if p is not None and not p.fut.done():
                p.fut.set_exception(SupervisionError(failure))

    def fail_all(self, failure_of: Any) -> None:
        """Fail every call in flight with ``SupervisionError(failure_of(addr))``."""
        for p in self._pending.values():
            if not p.fut.done():
                p.fut.set_exception(SupervisionError(failure_of(p.addr)))
        self._pending.clear()
        self._by_addr.clear()

    # ---- calls in -----------------------------------------------------------------------

    def on_call(self, ident: bytes, msg: Call, bufs: list) -> None:
        """A call to an actor of this process: hand it to the actor's host."""
        rid, actor, method, want_reply = msg.rid, msg.actor, msg.method, msg.want_reply
        try:
            payload, bufs = take_payload(msg.payload, bufs, msg.shm)
        except Exception as e:
            if msg.payload is not None or msg.shm:  # a missing payload frame is malformed
                if want_reply:
                    self.reply(ident, rid, R_ERROR, [actor, -1, method, e, ""])
                return
            raise
        host = self._actors.get(actor)
        if host is None:
            failed = self._actors.failed_spawn(actor)
            if failed is not None:
                if want_reply:
                    self.reply(ident, rid, R_DEAD, failed)
                return
            if want_reply:
                exc = LookupError(f"no actor named {actor!r} in process {self._proc_id!r}")
                self.reply(ident, rid, R_ERROR, [actor, -1, method, exc, ""])
            return
        host.deliver(Incoming(ident, rid, method, msg.mrank, want_reply, payload, bufs))

    def on_auth(self, ident: bytes, msg: AuthHello) -> None:
        """A verified hello: ack its nonce (signed, so it proves our secret)."""
        self._transport.stats["auth_handshakes"] += 1
        self.reply(ident, msg.rid, R_OK, msg.nonce)

    def reply(self, ident: bytes, rid: int, status: int, value: Any, who: tuple = ("", -1, "")) -> None:
        """Reply to a call; ``who`` (actor, rank, method) names the replier in errors."""
        try:
            payload, buffers = _wire.encode(value)
        except Exception as e:  # e.g. the endpoint returned an unregistered type
            status = R_ERROR
            err = TypeError(f"could not send the return value of {who[2]!r}: {e}")
            payload, buffers = _wire.encode([who[0], who[1], who[2], err, ""])
        self._transport.send_reply(ident, rid, status, payload, buffers)

    def on_malformed(self, ident: bytes, msg: Any, exc: BaseException) -> None:
        """Handling ``msg`` raised: count it; a waiting caller is told."""
        self._transport.stats["dropped_malformed"] += 1
        traceback.print_exc()
        if type(msg) is Call and msg.want_reply:
            self.reply(ident, msg.rid, R_ERROR, [msg.actor, -1, msg.method, exc, traceback.format_exc()])
