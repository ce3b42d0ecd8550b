"""Meshes: HostMesh -> ProcMesh -> ActorMesh, and the endpoint adverbs (call, call_one,
choose, stream, broadcast). What the adverbs give back is in relay/_future.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import os
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic

from . import _wire
from ._actor import EndpointSpec, _current, class_path, endpoints_of
from ._calls import AUTH_TIMEOUT
from ._errors import SupervisionError
from ._future import (
    Future,
    R,
    ValueMesh,
    _chain,
    _future_from_thread,
    _stream,
    _wait_shared,
    default_timeout,
)
from ._messages import Spawn
from ._processes import ProcRef
from ._runtime import Runtime, current_runtime
from ._settings import settings
from ._shape import Point, View

# ------------------------------------------------------------------------------------------
# ActorMesh and endpoints


@dataclass
class _Member:
    proc: ProcRef
    point: Point  # position in the mesh as spawned


class _SpawnState:
    """Orders the first calls behind the spawn messages (invariant ORDER: init first)."""

    def __init__(self, rt: Runtime | None):
        self.rt = rt
        self.sent = rt is None  # meshes decoded from the wire were spawned elsewhere
        self.queue: list[Callable[[], None]] = []
        self.initialized: asyncio.Future | None = None

    def run(self, send: Callable[[], None]) -> None:
        if self.sent:
            send()
        else:
            self.queue.append(send)

    def flush(self) -> None:
        queue, self.queue = self.queue, []
        self.sent = True
        for send in queue:
            send()


class ActorMesh:
    """Actors of one class, one per process of a ProcMesh. Endpoints are attributes:
    ``mesh.method.call(...)``. ``slice(**dims)`` gives a sub-mesh with the same actors."""

    def __init__(self, name: str, cls_path: str, specs: dict[str, EndpointSpec], view: View, state: _SpawnState):
        self._name = name
        self._cls_path = cls_path
        self._specs = specs
        self._view = view
        self._state = state

    def __getattr__(self, attr: str) -> EndpointRef:
        specs = self.__dict__.get("_specs")
        if specs is not None and attr in specs:
            return EndpointRef(self, specs[attr], None)
        raise AttributeError(f"actor mesh {self.__dict__.get('_name')!r} has no endpoint {attr!r}")

    @property
    def name(self) -> str:
        return self._name

    @property
    def extent(self) -> dict[str, int]:
        return dict(self._view.dims)

    def __len__(self) -> int:
        return len(self._view)

    def slice(self, **dims: int | slice) -> ActorMesh:
        return ActorMesh(self._name, self._cls_path, self._specs, self._view.slice(**dims), self._state)

    def _flat(self, indices: list[int]) -> ActorMesh:
        members = [self._view.members[i] for i in indices]
        return ActorMesh(self._name, self._cls_path, self._specs, View({"ranks": len(members)}, members), self._state)

    async def initialized(self, timeout: float | None = None) -> None:
        """Wait until every actor's ``__init__`` (and ``setup``) finished; raises its error."""
        st = self._state
        if st.initialized is None:
            return
        t = default_timeout() if timeout is None else timeout
        await _wait_shared(st.initialized, t, f"actor mesh {self._name!r} did not initialize")

    def __repr__(self) -> str:
        return f"ActorMesh({self._name!r}, {self._cls_path}, {self._view.dims})"

    # Wire form: a reference any process can call through.
    def _to_wire(self) -> dict:
        st = self._state
        if st.initialized is not None and not st.initialized.done():
            # Another process calling through this reference would not be ordered behind
            # the spawn message (FIFO holds per sender only) and could reach the actor first.
            raise RuntimeError(
                f"actor mesh {self._name!r} is still being spawned; await mesh.initialized() "
                "before passing it to another actor"
            )
        return {
            "name": self._name,
            "cls": self._cls_path,
            "dims": self._view.dims,
            "members": [[m.proc, m.point.rank, m.point.coords, m.point.extent] for m in self._view.members],
            "endpoints": [[s.name, s.is_async, s.concurrent, s.timeout] for s in self._specs.values()],
        }

    @classmethod
    def _from_wire(cls, d: dict) -> ActorMesh:
        specs = {name: EndpointSpec(name, *rest) for name, *rest in d["endpoints"]}
        members = [_Member(proc, Point(rank, coords, extent)) for proc, rank, coords, extent in d["members"]]
        return cls(d["name"], d["cls"], specs, View(d["dims"], members), _SpawnState(None))


_wire.register_codec(ActorMesh, "relay.ActorMesh", ActorMesh._to_wire, ActorMesh._from_wire)


class EndpointRef(Generic[R]):
    """An endpoint of an actor mesh; its methods are the adverbs."""

    __slots__ = ("_mesh", "_spec", "_timeout")

    def __init__(self, mesh: ActorMesh, spec: EndpointSpec, timeout: float | None):
        self._mesh = mesh
        self._spec = spec
        self._timeout = timeout

    def options(self, *, timeout: float | None = None) -> EndpointRef[R]:
        """The same endpoint with a default timeout (seconds) for its futures and streams."""
        return EndpointRef(self._mesh, self._spec, timeout)

    def _t(self) -> float:
        if self._timeout is not None:
            return self._timeout
        return self._spec.timeout if self._spec.timeout is not None else default_timeout()

    def _what(self, n: int | None = None) -> str:
        ranks = f" ({n} ranks)" if n is not None else ""
        return f"{self._mesh._name}.{self._spec.name}{ranks}"

    def _check_reentry(self, mesh: ActorMesh) -> None:
        host = _current.get()
        if host is None or self._spec.concurrent or mesh._name != host.name:
            return
        for m in mesh._view.members:
            if m.proc.proc_id == host.proc_id:
                raise RuntimeError(
                    f"actor {host.name!r} called its own endpoint {self._spec.name!r} through its mesh; "
                    "it handles one message at a time, so this would deadlock. Call the method "
                    "directly (self.method(...)) or mark it @endpoint(concurrent=True)"
                )

    def _send(self, rt: Runtime, mesh: ActorMesh, args: tuple, kwargs: dict, want_reply: bool, on_part) -> None:
        self._check_reentry(mesh)
        payload, buffers = _wire.encode([list(args), kwargs])  # unencodable args fail here, at the sender
        name, method = mesh._name, self._spec.name
        members = mesh._view.members

        def send() -> None:
            for i, m in enumerate(members):
                f = rt.calls.call(m.proc, name, method, i, payload, buffers, want_reply)
                if on_part is not None:
                    on_part(i, f)

        mesh._state.run(send)

    def _gathered(self, rt: Runtime, mesh: ActorMesh, args, kwargs) -> asyncio.Future:
        n = len(mesh._view)
        results: list[Any] = [None] * n
        agg = rt.loop.create_future()
        left = [n]
        errors: list[tuple[int, BaseException]] = []

        def part_done(i: int, f: asyncio.Future) -> None:
            def cb(f: asyncio.Future) -> None:
                if f.cancelled():
                    errors.append((i, asyncio.CancelledError()))
                elif f.exception() is not None:
                    errors.append((i, f.exception()))
                else:
                    results[i] = f.result()
                left[0] -= 1
                if left[0] == 0 and not agg.done():
                    if errors:
                        agg.set_exception(min(errors, key=lambda e: e[0])[1])
                    else:
                        agg.set_result(ValueMesh(View(mesh._view.dims, results)))

            f.add_done_callback(cb)

        self._send(rt, mesh, args, kwargs, True, part_done)
        return agg

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[R]]:
        """Call every actor of the mesh; the future gives a ValueMesh in rank order. If any
        rank fails, awaiting raises the error of the lowest failed rank."""
        rt = current_runtime()
        if not rt.in_loop_thread():
            return _future_from_thread(rt, lambda: self.call(*args, **kwargs), self._what(), self._t())
        return Future(rt, self._gathered(rt, self._mesh, args, kwargs), self._t(), self._what(len(self._mesh)))

    def call_one(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Call the only actor of a one-actor mesh (ValueError otherwise)."""
        if len(self._mesh) != 1:
            raise ValueError(
                f"call_one needs a mesh of exactly one actor; {self._mesh._name!r} has "
                f"{len(self._mesh)} (slice it first, or use call/choose)"
            )
        return self._single(self._mesh, args, kwargs)

    def choose(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Call one actor of the mesh picked uniformly at random."""
        i = random.randrange(len(self._mesh))
        return self._single(self._mesh._flat([i]), args, kwargs)

    def _single(self, mesh: ActorMesh, args, kwargs) -> Future[R]:
        rt = current_runtime()
        if not rt.in_loop_thread():
            return _future_from_thread(rt, lambda: self._single(mesh, args, kwargs), self._what(), self._t())
        got: list[asyncio.Future] = []
        self._send(rt, mesh, args, kwargs, True, lambda _, f: got.append(f))
        if got:  # sent already (the usual case): the reply future is the result
            return Future(rt, got[0], self._t(), self._what())
        out = rt.loop.create_future()  # queued behind the spawn: chain it when it is sent
        mesh._state.queue.append(lambda: got[0].add_done_callback(lambda f: _chain(f, out)))
        return Future(rt, out, self._t(), self._what())

    def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[R]:
        """Call every actor; iterate over replies in arrival order. An error is raised when
        its reply arrives; the timeout bounds the whole stream."""
        rt = current_runtime()
        if not rt.in_loop_thread():
            raise RuntimeError("stream() needs the runtime's event loop; use call() from threads")
        queue: asyncio.Queue = asyncio.Queue()
        self._send(rt, self._mesh, args, kwargs, True, lambda i, f: f.add_done_callback(queue.put_nowait))
        return _stream(rt, queue, len(self._mesh), self._t(), self._what(len(self._mesh)))

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every actor without waiting for (or getting) replies. If the endpoint
        raises, nobody can be told, so the actor fails and its owner is notified."""
        rt = current_runtime()
        if not rt.in_loop_thread():
            ctx = contextvars.copy_context()
            payload_check = _wire.encode((args, kwargs))  # fail at the sender, in the caller's thread
            del payload_check
            rt.loop.call_soon_threadsafe(lambda: self.broadcast(*args, **kwargs), context=ctx)
            return
        self._send(rt, self._mesh, args, kwargs, False, None)


# ------------------------------------------------------------------------------------------
# ProcMesh and HostMesh


class ProcMesh:
    """Real OS processes with named dims (``hosts`` plus the per-host dims)."""

    def __init__(self, name: str, view: View, rt: Runtime, ready: asyncio.Future, owned: bool = True):
        self._name = name
        self._view = view  # members: ProcRef
        self._rt = rt
        self._ready = ready
        self._owned = owned
        self._actor_names: set[str] = set()

    @property
    def name(self) -> str:
        return self._name

    @property
    def extent(self) -> dict[str, int]:
        return dict(self._view.dims)

    def __len__(self) -> int:
        return len(self._view)

    @property
    def procs(self) -> list[ProcRef]:
        return list(self._view.members)

    def slice(self, **dims: int | slice) -> ProcMesh:
        sub = ProcMesh(self._name, self._view.slice(**dims), self._rt, self._ready, self._owned)
        sub._actor_names = self._actor_names
        return sub

    async def ready(self, timeout: float = 60.0) -> None:
        """Wait until every process has started and said hello."""
        await _wait_shared(self._ready, timeout, f"proc mesh {self._name!r} did not start")

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> ActorMesh:
        """Spawn one ``cls(*args, **kwargs)`` actor per process; returns at once. Each actor's
        ``__init__`` runs before any message to it. Invalid actor classes fail here."""
        rt = current_runtime()
        if not rt.in_loop_thread():
            cf = concurrent.futures.Future()
            ctx = contextvars.copy_context()

            def run() -> None:
                try:
                    cf.set_result(self.spawn(name, cls, *args, **kwargs))
                except BaseException as e:
                    cf.set_exception(e)

            rt.loop.call_soon_threadsafe(run, context=ctx)
            return cf.result(60)
        if rt is not self._rt:
            raise RuntimeError("spawn from the event loop that created the proc mesh")
        if not isinstance(name, str) or not name:
            raise ValueError(f"actor mesh name must be a non-empty str, got {name!r}")
        specs = endpoints_of(cls)
        if name in self._actor_names:
            raise ValueError(f"an actor mesh named {name!r} already exists on proc mesh {self._name!r}")
        payload, buffers = _wire.encode([list(args), kwargs])
        if buffers:
            raise TypeError("spawn arguments cannot contain arrays or tensors; send them in a call after spawning")
        self._actor_names.add(name)
        points = self._view.points()
        members = [_Member(p, pt) for p, pt in zip(self._view.members, points)]
        state = _SpawnState(rt)
        state.initialized = rt.loop.create_future()
        mesh = ActorMesh(name, class_path(cls), specs, View(self._view.dims, members), state)
        owner = _current.get()
        owner_actor = owner.name if owner is not None else ""
        owner_addr = rt.ensure_inbox()
        rt.loop.create_task(self._spawn(rt, mesh, payload, owner_addr, owner_actor))
        return mesh

    async def _spawn(self, rt: Runtime, mesh: ActorMesh, payload: bytes, owner_addr: str, owner_actor: str) -> None:
        state = mesh._state
        await asyncio.wait([self._ready])
        if self._ready.cancelled() or self._ready.exception() is not None:
            state.flush()  # calls then fail fast: their processes are marked dead
            err = SupervisionError if self._ready.cancelled() else None
            if not state.initialized.done():
                state.initialized.set_exception(
                    RuntimeError(f"proc mesh {self._name!r} was cancelled") if err else self._ready.exception()
                )
                state.initialized.exception()
            return
        futs = []
        for m in mesh._view.members:
            pt = m.point
            point = [pt.rank, pt.coords, pt.extent]
            spawn = Spawn(0, mesh._name, mesh._cls_path, payload, point, self._name, owner_addr, owner_actor)
            futs.append(rt.calls.request(m.proc.addr, spawn))
        state.flush()
        results = await asyncio.gather(*futs, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            state.initialized.set_exception(errors[0])
            state.initialized.exception()  # retrieved: reported through supervision too
        else:
            state.initialized.set_result(None)

    async def stop(self, timeout: float = 10.0, procs: list[ProcRef] | None = None) -> None:
        """Stop these processes (or only ``procs``, some of them): actors' ``__cleanup__``
        runs, then they exit; whatever is left after ``timeout`` is killed. A stopped process
        is not a failure. Calls in flight fail with SupervisionError."""
        if not self._owned:
            raise RuntimeError(f"proc mesh {self._name!r} was not spawned by this process; stop it through its owner")
        members = self._view.members
        if procs is not None:
            ids = {r.proc_id for r in procs}
            members = [r for r in members if r.proc_id in ids]
        await self._rt.procs.stop_procs(members, timeout)

    @classmethod
    def attach(cls, procs: list[ProcRef], name: str = "attached", dims: dict[str, int] | None = None) -> ProcMesh:
        """A mesh over processes another process spawned (e.g. workers a node agent
        started), to spawn actors on them or reach actors already there. Their owner (the
        spawner) supervises them; this mesh cannot stop them."""
        rt = current_runtime()
        ready = rt.loop.create_future()
        ready.set_result(None)
        return cls(name, View(dims or {"procs": len(procs)}, list(procs)), rt, ready, owned=False)

    async def authenticate(self, timeout: float = AUTH_TIMEOUT) -> None:
        """Check that every process of this mesh shares this process's job secret, by an
        authenticated handshake (for meshes reached from outside the job, e.g. attached by
        address). Raises :class:`AuthenticationError` when one rejects it or none answers
        within ``timeout``, naming RELAY_JOB_SECRET / RELAY_JOB_SECRET_FILE; without it, a
        call signed with another secret is dropped and only its own timeout ends it."""
        await asyncio.gather(*(self._rt.calls.authenticate(p.addr, timeout) for p in self._view.members))

    def actors(self, name: str, cls: type) -> ActorMesh:
        """A reference to the actors named ``name`` (of class ``cls``) already running on
        these processes."""
        members = [_Member(p, pt) for p, pt in zip(self._view.members, self._view.points())]
        return ActorMesh(name, class_path(cls), endpoints_of(cls), View(self._view.dims, members), _SpawnState(None))

    def __repr__(self) -> str:
        return f"ProcMesh({self._name!r}, {self._view.dims})"


class HostMesh:
    """The hosts a job runs on. Locally, ``this_host()`` is a mesh of one host.

    The seam for multi-node launches: a host mesh spawns its processes through host agents;
    the local agent is this process itself.
    """

    def __init__(self, hosts: list[str]):
        self._hosts = hosts

    @property
    def extent(self) -> dict[str, int]:
        return {"hosts": len(self._hosts)}

    def spawn_procs(
        self,
        per_host: dict[str, int] | None = None,
        env: dict[str, str] | Callable[[Point], dict[str, str]] | None = None,
        name: str = "procs",
    ) -> ProcMesh:
        """Start ``prod(per_host.values())`` processes per host; returns at once.

        Dims of the result: ``hosts`` then the per-host dims (e.g. ``{"gpus": 4}``; on a CPU
        machine "gpus" is only a label). ``env``: extra environment for every process, or a
        function of each process's Point. Failures of these processes go to the spawning
        actor's ``__supervise__`` (or, at the root, to the unhandled fault hook).
        """
        per_host = dict(per_host or {"gpus": 1})
        if "hosts" in per_host:
            raise ValueError("per_host must not contain the 'hosts' dim")
        dims = {"hosts": len(self._hosts), **per_host}
        rt = current_runtime()
        if not rt.in_loop_thread():
            cf = concurrent.futures.Future()
            ctx = contextvars.copy_context()

            def run() -> None:
                try:
                    cf.set_result(self.spawn_procs(per_host, env, name))
                except BaseException as e:
                    cf.set_exception(e)

            rt.loop.call_soon_threadsafe(run, context=ctx)
            return cf.result(60)
        points = View(dims, [None] * _prod(dims)).points()
        envs = []
        for pt in points:
            e = env(pt) if callable(env) else dict(env or {})
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in e.items()):
                raise TypeError("env must map str to str")
            envs.append(e)
        owner = _current.get()
        owned = rt.procs.spawn_local(name, len(points), envs, owner.name if owner is not None else "")
        ready = asyncio.ensure_future(asyncio.gather(*(o.hello for o in owned)), loop=rt.loop)
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # reported via supervision
        return ProcMesh(name, View(dims, [o.ref for o in owned]), rt, ready)


def _prod(dims: dict[str, int]) -> int:
    n = 1
    for v in dims.values():
        n *= v
    return n


def this_proc() -> ProcMesh:
    """This process as a one-process mesh: ``this_proc().spawn(...)`` hosts actors here."""
    rt = current_runtime()
    addr = rt.ensure_inbox()
    ref = ProcRef(rt.proc_id, addr, "this_proc", 0, settings().host, os.getpid())
    ready = rt.loop.create_future()
    ready.set_result(None)
    return ProcMesh("this_proc", View({"procs": 1}, [ref]), rt, ready, owned=False)


def this_host() -> HostMesh:
    """The host this process runs on, as a one-host mesh."""
    return HostMesh([settings().host])


__all__ = ["ActorMesh", "EndpointRef", "Future", "HostMesh", "ProcMesh", "ValueMesh", "this_host", "SupervisionError"]
