"""The per-process (per event loop) runtime, composed of its parts. Private: the public API
is in relay/__init__.py.

- relay/_transport.py: the inbox, peers, frames, MACs and shared-memory buffers;
- relay/_calls.py: calls in flight and their replies, calls in, the auth handshake;
- relay/_host.py: the actors this process hosts;
- relay/_processes.py: the processes it owns or watches, and where their failures go.

The runtime routes what its inbox receives to these parts and owns their lifecycle.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from typing import Any

from . import _shm, _wire
from ._actor import _runtime_var
from ._calls import CallTable
from ._errors import MeshFailure
from ._host import Actors
from ._messages import AuthHello, Call, Event, Message, Spawn, Started, Stop
from ._processes import Processes, failure_of, stopped
from ._settings import Settings, settings
from ._transport import Transport


class Runtime:
    """All relay state of one event loop in one process."""

    def __init__(self, loop: asyncio.AbstractEventLoop, bind: str | None = None):
        self.loop = loop
        self.thread_id = threading.get_ident()
        self.settings: Settings = settings()
        self.proc_id = self.settings.proc_id or f"root-{os.getpid()}"
        self.closed = False
        self.transport = Transport(
            loop, self.proc_id, self.settings, bind, self._on_inbox, self._on_reply, self._on_rejected,
            self._on_disconnect,
        )
        self.actors = Actors(self)
        self.calls = CallTable(loop, self.transport, self.actors, self.proc_id)
        self.procs = Processes(self)
        # The job's root owns the job's shared-memory directory (workers inherit its id).
        self._owns_shm = not self.settings.is_worker
        if self.transport.uses_shm and self._owns_shm:
            _shm.create_job_dir()
        self.stopped = loop.create_future()  # set when a worker is told to stop
        self._keeper = loop.create_task(self._keep()) if loop.is_running() else None

    @property
    def address(self) -> str | None:
        """This process's inbox address (None until ``ensure_inbox``)."""
        return self.transport.address

    @property
    def stats(self) -> Any:
        return self.transport.stats

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread_id

    def ensure_inbox(self) -> str:
        return self.transport.ensure_inbox()

    def send_to(self, addr: str, msg: Message, buffers: list = ()) -> None:
        self.transport.send(self.transport.peer(addr), msg, buffers)

    # ---- what arrives -------------------------------------------------------------------

    def _on_inbox(self, ident: bytes, msg: Message, bufs: list) -> None:
        try:
            kind = type(msg)
            if kind is Call:
                self.calls.on_call(ident, msg, bufs)
            elif kind is Spawn:
                self.actors.on_spawn(ident, msg)
            elif kind is Stop:
                self.loop.create_task(self.on_stop())
            elif kind is AuthHello:
                self.calls.on_auth(ident, msg)
            elif kind is Started:
                self.procs.on_started(msg)
            elif kind is Event:
                self.procs.on_failure_event(msg.owner_actor, _wire.decode(msg.payload, bufs))
            else:  # a Reply belongs on a peer socket
                self.transport.stats["dropped_malformed"] += 1
        except Exception as e:
            self.calls.on_malformed(ident, msg, e)

    def _on_reply(self, msg: Any, bufs: list) -> None:
        self.calls.on_reply(msg, bufs)

    def _on_rejected(self, addr: str) -> None:
        self.calls.on_rejected(addr)

    def _on_disconnect(self, addr: str) -> None:
        if addr in self.calls.dead or self.procs.owns(addr):
            return  # known, or our own child: pidfd / heartbeats give the precise reason
        reason = "connection lost (the process exited or its host is unreachable)"
        ref = self.calls.peers.get(addr)
        if ref is None:  # never called from here: only its address is known
            failure = MeshFailure("?", "?", -1, "connection", reason, addr=addr)
        else:
            failure = failure_of(ref, "connection", reason)
        self.calls.mark_dead(addr, failure)

    # ---- lifecycle ----------------------------------------------------------------------

    async def _keep(self) -> None:
        """Lives as long as the loop: when asyncio.run() ends, stop what this loop owns."""
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await self.shutdown()
            raise

    async def on_stop(self) -> None:
        """Graceful stop of this worker: actors' __cleanup__, owned meshes, then exit."""
        await self.actors.stop_all()
        await self.shutdown()
        # The inbox is closed now: the caller learns of the stop from this process's exit.
        if not self.stopped.done():
            self.stopped.set_result(None)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every owned process (gracefully, then by force) and close sockets."""
        if self.closed:
            return
        running = self.procs.running()
        if running:
            try:
                await self.procs.stop_procs(running, timeout=timeout)
            except Exception:
                pass
        self.kill_all()
        self.close()

    def kill_all(self) -> None:
        """Kill every owned process now (SIGKILL) and reap it. Safe from any thread or hook."""
        self.procs.kill_all()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.procs.close()
        self.transport.close()
        self.calls.fail_all(lambda addr: stopped(addr, "the runtime shut down"))
        self.transport.remove_ipc_dir()
        others_open = any(r is not self and not r.closed for r in all_runtimes())
        if self.transport.uses_shm and self._owns_shm and not others_open:
            _shm.remove_job_dir()
        if self._keeper is not None and not self._keeper.done() and not self.loop.is_closed():
            self._keeper.cancel()
        _runtimes.pop(self.loop, None)


# ------------------------------------------------------------------------------------------
# Which runtime serves the caller


_runtimes: dict[asyncio.AbstractEventLoop, Runtime] = {}
_sync_loop: asyncio.AbstractEventLoop | None = None


def all_runtimes() -> list[Runtime]:
    return list(_runtimes.values())


def current_runtime() -> Runtime:
    """The runtime of the calling actor, else of the running loop, else of a private loop
    used by blocking ``.get()`` calls made outside any event loop."""
    rt = _runtime_var.get()
    if rt is not None and not rt.closed:
        return rt
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        global _sync_loop
        if _sync_loop is None or _sync_loop.is_closed():
            _sync_loop = asyncio.new_event_loop()
        loop = _sync_loop
    rt = _runtimes.get(loop)
    if rt is None:
        rt = Runtime(loop)
        _runtimes[loop] = rt
    return rt


def install_runtime(rt: Runtime) -> None:
    _runtimes[rt.loop] = rt
    _runtime_var.set(rt)


@atexit.register
def _kill_owned_at_exit() -> None:
    for rt in all_runtimes():
        rt.kill_all()
        rt.transport.remove_ipc_dir()
        if rt._owns_shm:
            _shm.remove_job_dir()
