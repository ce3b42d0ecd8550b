"""relay: a Monarch-style actor runtime over ZeroMQ + msgpack (+ uvloop). Imports without torch.

    from relay import Actor, endpoint, this_host

    class Counter(Actor):
        def __init__(self, start: int):
            self.n = start

        @endpoint
        async def incr(self, by: int = 1) -> int:
            self.n += by
            return self.n

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    counters = procs.spawn("counters", Counter, 0)
    values = await counters.incr.call(5)          # ValueMesh [5, 5]
    await procs.stop()

See docs/relay.md for semantics (ordering, errors, supervision, wire, security).
"""

from ._actor import Actor, Context, context, endpoint
from ._distributed import setup_torch_distributed
from ._errors import ActorError, AuthenticationError, CallTimeout, MeshFailure, SupervisionError
from ._mesh import (
    ActorMesh,
    EndpointRef,
    Future,
    HostMesh,
    ProcMesh,
    ValueMesh,
    this_host,
    this_proc,
)
from ._runtime import ProcRef, current_runtime, set_unhandled_fault_hook
from ._shape import Point
from ._wire import RemoteException, register

__version__ = "0.1.0"


def transport_stats() -> dict[str, int]:
    """Counters of this process's runtime: dropped_unauthenticated, dropped_malformed,
    auth_handshakes (hellos acked), auth_rejections_sent / auth_rejections_suppressed
    (rejections of unauthenticated hellos, and those withheld by the rate limit), ..."""
    return dict(current_runtime().stats)


__all__ = [
    "Actor",
    "ActorError",
    "ActorMesh",
    "AuthenticationError",
    "CallTimeout",
    "Context",
    "EndpointRef",
    "Future",
    "HostMesh",
    "MeshFailure",
    "Point",
    "ProcMesh",
    "ProcRef",
    "RemoteException",
    "SupervisionError",
    "ValueMesh",
    "context",
    "endpoint",
    "register",
    "set_unhandled_fault_hook",
    "setup_torch_distributed",
    "this_host",
    "this_proc",
    "transport_stats",
]
