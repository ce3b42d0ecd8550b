"""What adverbs give back: Future (await, result with a timeout, get from a thread) and
ValueMesh (one value per rank), and the helpers that wait on shared futures."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import _wire
from ._errors import CallTimeout
from ._settings import settings
from ._shape import Point, View

if TYPE_CHECKING:
    from ._runtime import Runtime

R = TypeVar("R")


_DEFAULT_TIMEOUT: list = []


def default_timeout() -> float:
    """RELAY_CALL_TIMEOUT (seconds, default 600), read once."""
    if not _DEFAULT_TIMEOUT:
        _DEFAULT_TIMEOUT.append(settings().call_timeout)
    return _DEFAULT_TIMEOUT[0]

# ------------------------------------------------------------------------------------------
# Future


class Future(Generic[R]):
    """The result of an adverb. ``await fut`` (default timeout), ``await fut.result(t)``, or
    ``fut.get(t)`` from code that is not running an event loop (e.g. a sync endpoint).

    A timeout raises :class:`CallTimeout` and does not consume the future: wait again if you like.
    """

    __slots__ = ("_rt", "_fut", "_timeout", "_what")

    def __init__(self, rt: Runtime, fut: asyncio.Future, timeout: float, what: str):
        # An error nobody awaits is dropped quietly, as for a fire-and-forget call.
        fut.add_done_callback(_retrieve)
        self._rt = rt
        self._fut = fut
        self._timeout = timeout
        self._what = what

    def __await__(self):
        return self.result().__await__()

    async def result(self, timeout: float | None = None) -> R:
        fut = self._fut
        if not fut.done():
            t = self._timeout if timeout is None else timeout
            loop = self._rt.loop
            waiter = loop.create_future()

            def wake(_: Any = None) -> None:
                if not waiter.done():
                    waiter.set_result(None)

            fut.add_done_callback(wake)
            handle = loop.call_later(t, wake)
            try:
                await waiter
            finally:
                handle.cancel()
                fut.remove_done_callback(wake)
            if not fut.done():
                raise CallTimeout(f"{self._what} did not answer within {t:g} s")
        return fut.result()

    def get(self, timeout: float | None = None) -> R:
        rt = self._rt
        if rt.loop.is_running():
            if rt.in_loop_thread():
                raise RuntimeError("Future.get() would block the event loop: use 'await' here")
            return asyncio.run_coroutine_threadsafe(self.result(timeout), rt.loop).result()
        return rt.loop.run_until_complete(self.result(timeout))

    def done(self) -> bool:
        return self._fut.done()


def _retrieve(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()


def _future_from_thread(rt: Runtime, make: Callable[[], Future], what: str, timeout: float) -> Future:
    """Run an adverb issued from a thread other than the runtime's on the runtime's loop."""
    ctx = contextvars.copy_context()
    cf: concurrent.futures.Future = concurrent.futures.Future()

    def start() -> None:
        try:
            inner = make()
        except BaseException as e:
            cf.set_exception(e)
            return
        inner._fut.add_done_callback(lambda f: _copy_result(f, cf))

    rt.loop.call_soon_threadsafe(start, context=ctx)
    return _ThreadFuture(rt, cf, timeout, what)


def _copy_result(src: asyncio.Future, dst: concurrent.futures.Future) -> None:
    if src.cancelled():
        dst.cancel()
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


class _ThreadFuture(Future):
    """A Future created off the runtime's loop thread: only ``get()`` applies."""

    __slots__ = ("_cf",)

    def __init__(self, rt: Runtime, cf: concurrent.futures.Future, timeout: float, what: str):
        self._rt, self._cf, self._timeout, self._what = rt, cf, timeout, what

    def __await__(self):
        return asyncio.wrap_future(self._cf).__await__()

    async def result(self, timeout: float | None = None):
        t = self._timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._cf)), t)
        except asyncio.TimeoutError:
            raise CallTimeout(f"{self._what} did not answer within {t:g} s") from None

    def get(self, timeout: float | None = None):
        t = self._timeout if timeout is None else timeout
        try:
            return self._cf.result(t)
        except concurrent.futures.TimeoutError:
            raise CallTimeout(f"{self._what} did not answer within {t:g} s") from None

    def done(self) -> bool:
        return self._cf.done()


# ------------------------------------------------------------------------------------------
# ValueMesh


class ValueMesh(Generic[R]):
    """One value per rank of the mesh a ``call`` went to, in rank order."""

    def __init__(self, view: View):
        self._view = view

    def __len__(self) -> int:
        return len(self._view)

    def __iter__(self) -> Iterator[R]:
        return iter(self._view.members)

    def values(self) -> list[R]:
        return list(self._view.members)

    def items(self) -> list[tuple[Point, R]]:
        return list(zip(self._view.points(), self._view.members))

    def item(self, **coords: int) -> R:
        sub = self._view.slice(**coords)
        if len(sub) != 1:
            raise ValueError(f"item() needs every dim of {list(self._view.dims)}, got {coords}")
        return sub.members[0]

    @property
    def extent(self) -> dict[str, int]:
        return dict(self._view.dims)

    def slice(self, **dims: int | slice) -> ValueMesh[R]:
        return ValueMesh(self._view.slice(**dims))

    def __repr__(self) -> str:
        return f"ValueMesh({self._view.dims}, {self._view.members!r})"


_wire.register_codec(
    ValueMesh, "relay.ValueMesh", lambda vm: [vm._view.dims, vm._view.members], lambda v: ValueMesh(View(*v))
)


async def _wait_shared(fut: asyncio.Future, timeout: float, what: str) -> None:
    """Wait for a future others share, without cancelling it if we are cancelled."""
    if not fut.done():
        await asyncio.wait([fut], timeout=timeout)
        if not fut.done():
            raise CallTimeout(f"{what} within {timeout:g} s")
    if fut.cancelled():
        raise RuntimeError(f"{what}: cancelled")
    exc = fut.exception()
    if exc is not None:
        raise exc


def _chain(src: asyncio.Future, dst: asyncio.Future) -> None:
    if dst.done():
        return
    if src.cancelled():
        dst.cancel()
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


async def _stream(rt: Runtime, queue: asyncio.Queue, n: int, timeout: float, what: str):
    deadline = rt.loop.time() + timeout
    for _ in range(n):
        left = deadline - rt.loop.time()
        try:
            f = await asyncio.wait_for(queue.get(), max(left, 0))
        except asyncio.TimeoutError:
            raise CallTimeout(f"{what} stream did not finish within {timeout:g} s") from None
        yield f.result()
