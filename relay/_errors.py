"""Failure types: ActorError (the caller's problem) vs SupervisionError (the owner's problem)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._wire import register


class ActorError(Exception):
    """An endpoint raised. Carries the remote exception and traceback; the actor lives on."""

    def __init__(self, actor: str, rank: int, method: str, exception: BaseException, remote_traceback: str):
        self.actor = actor
        self.rank = rank
        self.method = method
        self.exception = exception
        self.remote_traceback = remote_traceback
        super().__init__(
            f"actor {actor!r} rank {rank} raised in endpoint {method!r}: "
            f"{type(exception).__name__}: {exception}\n--- remote traceback ---\n{remote_traceback}"
        )


@register(name="relay.MeshFailure")
@dataclass
class MeshFailure:
    """Why a process or an actor of a mesh failed; given to the owner's ``__supervise__``.

    kind: ``exit`` (non-zero exit code), ``signal``, ``heartbeat`` (missed heartbeats),
    ``connection`` (connection lost, seen by a non-owner), ``actor`` (the actor failed:
    __init__ raised, a broadcast endpoint raised, or its own supervision was unhandled),
    ``stopped`` (the mesh was stopped on purpose; never sent to ``__supervise__``).
    """

    mesh: str
    proc_id: str
    rank: int
    kind: str
    reason: str
    pid: int = 0
    host: str = ""
    actor: str = ""
    detail: str = ""
    cause: list = field(default_factory=list)  # chained failures, oldest first (as strings)
    addr: str = ""  # inbox address of the failed process

    def __str__(self) -> str:
        who = f"actor {self.actor!r} on " if self.actor else ""
        where = f"pid {self.pid}" + (f" on {self.host}" if self.host else "")
        if self.rank < 0:  # a peer known only by its address (not spawned or called from here)
            text = f"{who}the process at {self.addr or self.proc_id}: {self.reason}"
        else:
            text = f"{who}process {self.proc_id!r} (rank {self.rank} of mesh {self.mesh!r}, {where}) {self.reason}"
        if self.detail:
            text += f"\n{self.detail}"
        for c in self.cause:
            text += f"\n  caused by: {c}"
        return text


class SupervisionError(Exception):
    """The target process or actor is dead (exit, signal, heartbeats, failed actor) or stopped."""

    def __init__(self, failure: MeshFailure):
        self.failure = failure
        super().__init__(f"{failure}")


class CallTimeout(TimeoutError):
    """No reply within the timeout; the call may still complete (awaiting again is allowed)."""


class AuthenticationError(ConnectionError):
    """The peer does not share this process's job secret (it rejected the authentication
    handshake), or no authenticated answer came within the handshake's timeout."""

    def __init__(self, addr: str, message: str):
        self.addr = addr
        super().__init__(message)
