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
from ._auth import job_secret, read_secret_file, write_secret_file
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
from ._processes import ProcRef, set_unhandled_fault_hook
from ._runtime import current_runtime as _current_runtime
from ._settings import Layer, Settings, Variable, configure_logging, settings
from ._shape import Point
from ._wire import RemoteException, register

__version__ = "0.1.0"


def transport_stats() -> dict[str, int]:
    """Counters of this process's runtime: dropped_unauthenticated, dropped_malformed,
    auth_handshakes (hellos acked), auth_rejections_sent / auth_rejections_suppressed
    (rejections of unauthenticated hellos, and those withheld by the rate limit), ..."""
    return dict(_current_runtime().stats)


def inbox_address() -> str:
    """The address other processes reach this process's runtime at (its inbox, started on
    first use): what a ProcRef to this process carries, e.g. for a client's mesh."""
    return _current_runtime().ensure_inbox()


def heartbeat_address() -> str:
    """The address of this process's heartbeat monitor (started on first use), where the
    processes it watches (:func:`watch_heartbeats`) send their beats (:func:`start_heartbeat`)."""
    return _current_runtime().procs.ensure_monitor()


def watch_heartbeats(ref: ProcRef, owner_actor: str = "") -> None:
    """Supervise a process this one did not spawn (e.g. a node agent started by torchrun)
    by its heartbeats: silence for ``RELAY_HEARTBEAT_TIMEOUT`` fails the calls in flight to
    it and is a failure for ``owner_actor``'s ``__supervise__`` (none: the fault hook)."""
    _current_runtime().procs.watch_remote(ref, owner_actor)


def unwatch_heartbeats(proc_id: str) -> None:
    """Stop watching a process (by its ``ProcRef.proc_id``); its silence is then no failure."""
    _current_runtime().procs.unwatch_remote(proc_id)


def prefork(modules) -> None:
    """Start this process's fork server: it imports ``modules`` (names, or
    ``"module:function"`` to also call one) once, in the background, and the worker
    processes this process spawns from then on are forked from it, starting with them
    imported (relay/_forkserver.py). Workers behave as without it; one it cannot fork starts
    as a new process. Call it early (before the spawns) on the loop thread; idempotent."""
    rt = _current_runtime()
    if not rt.in_loop_thread():
        rt.loop.call_soon_threadsafe(rt.procs.prefork, list(modules))
        return
    rt.procs.prefork(list(modules))


def start_heartbeat(address: str, proc_id: str) -> None:
    """Beat, on a thread of this process, to the monitor at ``address`` (another process's
    :func:`heartbeat_address`) as ``proc_id``. This process exits when the monitor stops
    acking for ``RELAY_PARENT_TIMEOUT`` seconds."""
    import zmq

    from ._heartbeat import Heartbeater

    Heartbeater(zmq.Context.instance(), address, proc_id, parent_pid=0).start()


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
    "Layer",
    "Settings",
    "SupervisionError",
    "ValueMesh",
    "Variable",
    "configure_logging",
    "context",
    "endpoint",
    "heartbeat_address",
    "inbox_address",
    "job_secret",
    "prefork",
    "read_secret_file",
    "register",
    "set_unhandled_fault_hook",
    "settings",
    "setup_torch_distributed",
    "start_heartbeat",
    "this_host",
    "this_proc",
    "transport_stats",
    "unwatch_heartbeats",
    "watch_heartbeats",
    "write_secret_file",
]
