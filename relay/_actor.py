"""Actors and endpoints: the user-facing definitions (no I/O here)."""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._shape import Point


@dataclass(frozen=True)
class EndpointSpec:
    name: str
    is_async: bool
    concurrent: bool
    timeout: float | None


def endpoint(fn: Callable | None = None, *, concurrent: bool = False, timeout: float | None = None):
    """Mark an actor method as callable through a mesh.

    Messages to one actor are handled one at a time in per-sender FIFO order. With
    ``concurrent=True`` (async methods only) a message's handler starts in order but later
    messages do not wait for it to finish. ``timeout`` is the default for callers (seconds).
    """

    def mark(f: Callable) -> Callable:
        if not callable(f):
            raise TypeError("@endpoint decorates methods")
        is_async = inspect.iscoroutinefunction(f)
        if concurrent and not is_async:
            raise TypeError(
                f"endpoint {f.__qualname__!r}: concurrent=True needs an async method "
                "(sync endpoints run one at a time on the actor's thread)"
            )
        f.__relay_endpoint__ = EndpointSpec(f.__name__, is_async, concurrent, timeout)
        return f

    return mark(fn) if fn is not None else mark


class Actor:
    """Base class for actors. Keep ``__init__`` cheap; put heavy work in ``setup()``.

    Optional hooks (sync or async): ``setup()`` runs after ``__init__`` and before the first
    message; ``__cleanup__(exc)`` runs when the actor's process stops (``exc`` is None on a
    normal stop; it does not run after a crash); ``__supervise__(failure)`` is called for a
    failure of a mesh this actor spawned: return True to mark it handled, else the actor fails
    and the failure goes on to this actor's owner.
    """


def endpoints_of(cls: type) -> dict[str, EndpointSpec]:
    """The endpoints of an actor class; rejects definitions that could deadlock."""
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"{cls!r} is not a subclass of relay.Actor")
    specs: dict[str, EndpointSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            spec = getattr(value, "__relay_endpoint__", None)
            if spec is not None:
                specs[name] = spec
            elif name in specs:
                del specs[name]  # overridden by a non-endpoint
    kinds = {s.is_async for s in specs.values()}
    if len(kinds) > 1:
        sync = sorted(n for n, s in specs.items() if not s.is_async)
        asyn = sorted(n for n, s in specs.items() if s.is_async)
        raise ValueError(
            f"actor class {cls.__qualname__} mixes both async and sync endpoints "
            f"(sync: {sync}; async: {asyn}). Sync endpoints run on the actor's own thread and "
            "async ones on its event loop, so mixing them would let them race; make them all "
            "async or all sync"
        )
    return specs


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


@dataclass(frozen=True)
class Context:
    """What an actor knows about itself while it handles a message (see :func:`context`)."""

    actor_name: str
    proc_id: str
    rank: int
    point: Point
    message_rank: int

    @property
    def coords(self) -> dict[str, int]:
        return self.point.coords

    @property
    def extent(self) -> dict[str, int]:
        return self.point.extent


_current: contextvars.ContextVar[Any] = contextvars.ContextVar("relay_actor", default=None)
_message_rank: contextvars.ContextVar[int] = contextvars.ContextVar("relay_message_rank", default=-1)
_runtime_var: contextvars.ContextVar[Any] = contextvars.ContextVar("relay_runtime", default=None)  # an actor's runtime


def context() -> Context:
    """The current actor's rank, coordinates and mesh extent; only valid inside an actor.

    ``rank`` is the actor's rank in the mesh it was spawned as; ``message_rank`` is its rank
    in the (possibly sliced) mesh the current message was sent to.
    """
    host = _current.get()
    if host is None:
        raise RuntimeError("relay.context() is only available inside an actor")
    mr = _message_rank.get()
    return Context(host.name, host.proc_id, host.point.rank, host.point, host.point.rank if mr < 0 else mr)
