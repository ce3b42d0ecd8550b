"""The actors hosted by one process: their instances, mailboxes and endpoint dispatch.

Each actor handles its mailbox one message at a time in arrival order (per-sender FIFO is
kept from the socket to the endpoint); a ``concurrent=True`` endpoint's handler is started
in order but not waited for. Sync actors run on a thread of their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import importlib
import importlib.util
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _wire
from ._actor import _current, _message_rank, _runtime_var, endpoints_of
from ._errors import MeshFailure
from ._messages import R_DEAD, R_ERROR, R_OK, Event, Spawn
from ._shape import Point

if TYPE_CHECKING:
    from ._runtime import Runtime


class Incoming(NamedTuple):
    """A call for an actor, as its mailbox holds it."""

    ident: bytes  # the caller's routing id on our inbox
    rid: int
    method: str
    mrank: int
    want_reply: bool
    payload: Any
    bufs: list


class _Supervise(NamedTuple):
    failure: MeshFailure


class _StopAsk(NamedTuple):
    done: asyncio.Future


# ------------------------------------------------------------------------------------------
# Actor classes defined in the spawner's __main__

_importing_main = False


def importing_main() -> bool:
    """Whether this process is importing its spawner's main script right now."""
    return _importing_main


def _import_main(main_file: str) -> Any:
    """The spawner's __main__ script, imported as __mp_main__ (as multiprocessing does: its
    ``if __name__ == "__main__":`` block does not run)."""
    global _importing_main
    mod = sys.modules.get("__mp_main__")
    if mod is not None:
        return mod
    if not main_file.endswith(".py") or not os.path.exists(main_file):
        raise ImportError("the actor class is defined in __main__, which is not a file this process can import")
    spec = importlib.util.spec_from_file_location("__mp_main__", main_file)
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


def _import_class(path: str, main_file: str) -> type:
    module, _, qual = path.partition(":")
    mod = _import_main(main_file) if module in ("__main__", "__mp_main__") else importlib.import_module(module)
    obj: Any = mod
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


# ------------------------------------------------------------------------------------------


class Actors:
    """The actors of one process, by name, and the spawns that failed."""

    def __init__(self, rt: Runtime):
        self._rt = rt
        self._hosts: dict[str, ActorHost] = {}
        self._failed: dict[str, MeshFailure] = {}

    def get(self, name: str) -> ActorHost | None:
        return self._hosts.get(name)

    def failed_spawn(self, name: str) -> MeshFailure | None:
        return self._failed.get(name)

    def on_spawn(self, ident: bytes, msg: Spawn) -> None:
        rt = self._rt
        rank, coords, extent = msg.point
        try:
            if msg.name in self._hosts:
                raise ValueError(f"an actor named {msg.name!r} already exists in process {rt.proc_id!r}")
            cls = _import_class(msg.cls_path, rt.settings.main_file)
            endpoints_of(cls)  # re-check on this side
            args, kwargs = _wire.decode(msg.payload, [])
        except Exception as e:
            tb = traceback.format_exc()
            rt.calls.reply(ident, msg.rid, R_ERROR, [msg.name, rank, "__init__", e, tb])
            failure = MeshFailure(
                msg.mesh, rt.proc_id, rank, "actor", f"could not be spawned: {type(e).__name__}: {e}",
                os.getpid(), rt.settings.host, actor=msg.name, detail=tb, addr=rt.address or "",
            )
            self._failed[msg.name] = failure
            payload, bufs = _wire.encode(failure)
            rt.send_to(msg.owner_addr, Event(msg.owner_actor, payload), bufs)
            return
        host = ActorHost(rt, msg.name, cls, args, kwargs, Point(rank, coords, extent), msg.mesh, msg.owner_addr,
                         msg.owner_actor)
        self._hosts[msg.name] = host
        host.start(ident, msg.rid)

    def supervise(self, owner_actor: str, failure: MeshFailure) -> bool:
        """Hand ``failure`` to ``owner_actor``'s ``__supervise__``; False if no such actor."""
        host = self._hosts.get(owner_actor) if owner_actor else None
        if host is None:
            return False
        host.deliver(_Supervise(failure))
        return True

    async def stop_all(self) -> None:
        for host in list(self._hosts.values()):
            await host.stop()


class ActorHost:
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
        self.executor = (
            None if self.is_async else concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"actor-{name}")
        )
        self._args, self._kwargs = args, kwargs
        self._task: asyncio.Task | None = None

    def start(self, ident: bytes, rid: int) -> None:
        ctx = contextvars.copy_context()
        ctx.run(_current.set, self)
        ctx.run(_runtime_var.set, self.rt)
        self._task = self.rt.loop.create_task(self._run(ident, rid), context=ctx)

    def deliver(self, item: Incoming | _Supervise) -> None:
        if self.failed is not None and type(item) is Incoming:
            if item.want_reply:
                self.rt.calls.reply(item.ident, item.rid, R_DEAD, self.failed)
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
        reply = self.rt.calls.reply
        try:
            self.instance = await self._invoke(self.cls, *self._args, **self._kwargs)
            setup = getattr(self.instance, "setup", None)
            if callable(setup):
                await self._invoke(setup)
        except BaseException as e:
            tb = traceback.format_exc()
            reply(ident, rid, R_ERROR, [self.name, self.point.rank, "__init__", e, tb])
            self.fail("failed in __init__/setup", tb)
            return
        reply(ident, rid, R_OK, None)
        while True:
            item = await self.mailbox.get()
            kind = type(item)
            if kind is Incoming:
                spec = self.specs.get(item.method)
                if spec is not None and spec.concurrent:
                    token = _message_rank.set(item.mrank)
                    self.rt.loop.create_task(self._handle(item))
                    _message_rank.reset(token)
                else:
                    await self._handle(item)
            elif kind is _Supervise:
                await self._supervise(item.failure)
            elif kind is _StopAsk:
                item.done.set_result(None)
                return
            if self.failed is not None:
                return

    async def _handle(self, item: Incoming) -> None:
        method, want_reply = item.method, item.want_reply
        _message_rank.set(item.mrank)
        try:
            if method not in self.specs:
                raise AttributeError(f"actor {self.name!r} ({self.cls.__qualname__}) has no endpoint {method!r}")
            args, kwargs = _wire.decode(item.payload, item.bufs)
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
            if want_reply:
                self.rt.calls.reply(item.ident, item.rid, R_ERROR, [self.name, self.point.rank, method, e, tb])
            if not (want_reply and isinstance(e, Exception)):
                # No one to tell (broadcast) or not an Exception: the actor dies (Monarch semantics).
                self.fail(f"failed: endpoint {method!r} raised {type(e).__name__}: {e}", tb)
            return
        if want_reply:
            self.rt.calls.reply(item.ident, item.rid, R_OK, result, (self.name, self.point.rank, method))

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
        rt = self.rt
        self.failed = MeshFailure(
            self.mesh, self.proc_id, self.point.rank, "actor", reason, os.getpid(), rt.settings.host,
            actor=self.name, detail=detail, cause=cause or [], addr=rt.address or "",
        )
        while not self.mailbox.empty():
            item = self.mailbox.get_nowait()
            if type(item) is Incoming and item.want_reply:
                rt.calls.reply(item.ident, item.rid, R_DEAD, self.failed)
            elif type(item) is _StopAsk:
                item.done.set_result(None)
        try:
            payload, bufs = _wire.encode(self.failed)
            rt.send_to(self.owner_addr, Event(self.owner_actor, payload), bufs)
        except Exception:
            traceback.print_exc()

    async def stop(self, timeout: float = 10.0) -> None:
        if self.failed is None and self._task is not None and not self._task.done():
            done = self.rt.loop.create_future()
            self.mailbox.put_nowait(_StopAsk(done))
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
