"""The messages relay processes exchange: one NamedTuple per kind, and their header bytes.

A message's header is the msgpack list ``[kind, *fields]`` (fields in the order of the
class below); encoded arguments, results and failures ride in it as msgpack bytes
(``payload``) or, when large, as the first buffer frame (``payload`` is then None). Frames,
MACs and shared memory are relay/_transport.py's business.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

from . import _wire

K_CALL, K_REPLY, K_SPAWN, K_STOP, K_HELLO, K_EVENT, K_AUTH = 1, 2, 3, 4, 5, 6, 7
R_OK, R_ERROR, R_DEAD = 0, 1, 2  # a reply's status: value, [actor, rank, method, exc, tb], MeshFailure

# A hello's header, [K_AUTH, rid, nonce] with a 32-character hex nonce, packs to a fixarray
# of 3 whose first item is the fixint K_AUTH, 37..45 bytes in all: an unauthenticated
# message is recognized as a hello by these bytes alone, without decoding it.
HELLO_PREFIX = bytes([0x93, K_AUTH])
HELLO_MAX = 45


class Call(NamedTuple):
    """Call ``method`` of ``actor``; ``mrank`` is the callee's rank in the mesh it was sent to."""

    KIND = K_CALL
    rid: int
    actor: str
    method: str
    mrank: int
    want_reply: bool
    payload: bytes | None  # encoded [args, kwargs]
    shm: list | None  # [[buffer index, shared-memory name, size], ...]


class Reply(NamedTuple):
    """The answer to a Call, Spawn or AuthHello with the same ``rid``."""

    KIND = K_REPLY
    rid: int
    status: int  # R_OK, R_ERROR or R_DEAD
    payload: bytes | None
    shm: list | None


class Spawn(NamedTuple):
    """Create actor ``name`` of class ``cls_path`` in the receiving process; replied to once
    its ``__init__`` and ``setup`` ran."""

    KIND = K_SPAWN
    rid: int
    name: str
    cls_path: str
    payload: bytes  # encoded [args, kwargs]
    point: list  # [rank, coords, extent]
    mesh: str
    owner_addr: str
    owner_actor: str


class Stop(NamedTuple):
    """Stop the receiving worker (actors' ``__cleanup__``, its own processes, then exit)."""

    KIND = K_STOP
    rid: int


class Started(NamedTuple):
    """A worker to its spawner: it runs and listens at ``addr``."""

    KIND = K_HELLO
    proc_id: str
    addr: str
    pid: int
    host: str


class Event(NamedTuple):
    """A failure (an encoded MeshFailure) for ``owner_actor``'s supervision."""

    KIND = K_EVENT
    owner_actor: str
    payload: bytes


class AuthHello(NamedTuple):
    """The authentication handshake: acked by a signed Reply echoing ``nonce``."""

    KIND = K_AUTH
    rid: int
    nonce: str


Message = Call | Reply | Spawn | Stop | Started | Event | AuthHello
_BY_KIND: dict[int, Any] = {c.KIND: c for c in (Call, Reply, Spawn, Stop, Started, Event, AuthHello)}

_packb = _wire.packb


def encode(msg: Message) -> bytes:
    """The header bytes of ``msg``."""
    return _packb([msg.KIND, *msg])


def decode(data: Any) -> Message:
    """The message of header bytes ``data``; ValueError when they are not one."""
    try:
        items = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise ValueError(f"undecodable header: {e}") from None
    if not isinstance(items, list) or not items:
        raise ValueError("a header is a non-empty list")
    cls = _BY_KIND.get(items[0]) if type(items[0]) is int else None
    if cls is None or len(items) != len(cls._fields) + 1:
        raise ValueError(f"no message of kind {items[0]!r} with {len(items) - 1} fields")
    return cls._make(items[1:])
