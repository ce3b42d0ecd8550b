"""The processes one runtime supervises, and where their failures go.

A runtime owns the worker processes it spawned (``spawn_local``): it learns of their exit
through a pidfd (or polling), of their silence through heartbeats (relay/_heartbeat.py),
and stops them (``stop_procs``, ``kill_all``). It may also watch processes it did not spawn
by their heartbeats (``watch_remote``). A failure goes to the owning actor's
``__supervise__``, else (at the root) to the unhandled fault hook.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _auth, _shm, _wire
from ._errors import MeshFailure, SupervisionError
from ._forkserver import start_worker
from ._heartbeat import STARTUP_GRACE, HeartbeatMonitor
from ._host import importing_main
from ._messages import Started, Stop
from ._transport import remove_reader

if TYPE_CHECKING:
    from ._runtime import Runtime


@dataclass
class ProcRef:
    """Where a process of a mesh lives; ``addr`` is its inbox (ROUTER) address."""

    proc_id: str
    addr: str
    mesh: str
    rank: int
    host: str = ""
    pid: int = 0


_wire.register(ProcRef, name="relay.ProcRef")


@dataclass
class Owned:
    """A worker process this runtime spawned."""

    ref: ProcRef
    popen: subprocess.Popen
    owner_actor: str
    hello: asyncio.Future  # set when it said it runs (Started)
    exited: asyncio.Future  # its exit code
    stopping: bool = False
    pidfd: int = -1


def failure_of(ref: ProcRef, kind: str, reason: str) -> MeshFailure:
    return MeshFailure(ref.mesh, ref.proc_id, ref.rank, kind, reason, ref.pid, ref.host, addr=ref.addr)


def stopped(addr: str, why: str, ref: ProcRef | None = None) -> MeshFailure:
    if ref is None:
        return MeshFailure("?", addr, -1, "stopped", why)
    return failure_of(ref, "stopped", f"was {why}" if why == "stopped" else why)


# ------------------------------------------------------------------------------------------
# Fault hook (root of the supervision tree)


def _default_fault_hook(failure: MeshFailure) -> None:
    sys.stderr.write(f"relay: unhandled failure, stopping the job:\n  {failure}\n")
    sys.stderr.flush()
    for procs in list(_ALL):
        procs.kill_all()
    os._exit(1)


_fault_hook: Callable[[MeshFailure], Any] = _default_fault_hook
_ALL: weakref.WeakSet = weakref.WeakSet()  # every Processes of this process (one per runtime)


def set_unhandled_fault_hook(hook: Callable[[MeshFailure], Any]) -> Callable[[MeshFailure], Any]:
    """Replace what happens to a failure nobody handled (default: print it, kill every
    process this one spawned, exit 1). Returns the previous hook."""
    global _fault_hook
    prev, _fault_hook = _fault_hook, hook
    return prev


# ------------------------------------------------------------------------------------------


class Processes:
    """The processes a runtime owns or watches."""

    def __init__(self, rt: Runtime):
        _ALL.add(self)  # the default fault hook kills every runtime's processes
        self._rt = rt
        self._loop = rt.loop
        self._owned: dict[str, Owned] = {}  # proc_id -> owned process
        self._remote: dict[str, tuple[ProcRef, str]] = {}  # proc_id -> (ref, owner actor): watched, not owned
        self._hb: HeartbeatMonitor | None = None
        self._mesh_seq = 0
        self._fork = None  # ForkServer, once prefork() started one

    def owns(self, addr: str) -> bool:
        return any(o.ref.addr == addr for o in self._owned.values())

    def running(self) -> list[ProcRef]:
        return [o.ref for o in self._owned.values() if not o.exited.done()]

    # ---- spawning -----------------------------------------------------------------------

    def spawn_local(self, mesh: str, count: int, envs: list[dict[str, str]], owner_actor: str) -> list[Owned]:
        """Start ``count`` worker processes on this host; they are owned by this runtime."""
        if importing_main():
            raise RuntimeError(
                "a worker re-imported your main script to find an actor class, and the script "
                "spawned processes at import time; put the script's top-level code under "
                "'if __name__ == \"__main__\":'"
            )
        rt = self._rt
        address = rt.ensure_inbox()
        hb_address = self.ensure_monitor()
        seq, self._mesh_seq = self._mesh_seq, self._mesh_seq + 1
        host = rt.settings.host
        # Every worker gets the job's secret and id (the root may have made them up).
        job = {_auth.SECRET_ENV: _auth.secret_hex(), "RELAY_JOB_ID": _shm.job_id()}
        out = []
        for i in range(count):
            root = rt.proc_id.startswith("root")
            proc_id = f"{mesh}-{seq}.{i}" if root else f"{rt.proc_id}/{mesh}-{seq}.{i}"
            # Same-host spawns use ipc; a tcp-listening runtime gives its workers tcp inboxes
            # (port chosen by the worker, learned from its hello).
            tcp = address.startswith("tcp://")
            addr = f"tcp://{host}:0" if tcp else f"ipc://{rt.transport.ipc_dir()}/p{seq}.{i}"
            env = dict(os.environ)
            env.update(job)
            env.update(envs[i])
            env.update(
                RELAY_PROC_ID=proc_id,
                RELAY_BIND=addr,
                RELAY_PARENT_ADDR=address,
                RELAY_PARENT_HB=hb_address,
                RELAY_PARENT_PID=str(os.getpid()),
                RELAY_SYS_PATH=os.pathsep.join(p for p in sys.path if p),
                RELAY_MAIN_FILE=getattr(sys.modules.get("__main__"), "__file__", "") or "",
            )
            forked = self._fork is not None and self._fork.alive
            if forked:  # a child of the fork server, which is then its parent
                env["RELAY_PARENT_PID"] = str(self._fork.pid)
                popen = self._fork.spawn(env, lambda proc_id=proc_id: self._forked_event(proc_id))
            else:
                popen = start_worker(env)
            ref = ProcRef(proc_id, addr, mesh, i, host, popen.pid)
            o = Owned(ref, popen, owner_actor, self._loop.create_future(), self._loop.create_future())
            self._owned[proc_id] = o
            self._hb.watch(proc_id)
            if not forked:
                self._watch_exit(o)
            out.append(o)
        return out

    def prefork(self, modules: list[str]) -> None:
        """Start this runtime's fork server (relay/_forkserver.py), importing ``modules``
        (``module`` or ``module:function`` to call) now, in the background; the workers
        spawned from then on are forked from it. Idempotent."""
        from ._forkserver import ForkServer

        if self._fork is None or not self._fork.alive:
            try:
                self._fork = ForkServer(self._loop, list(modules), dict(os.environ))
            except OSError as e:  # workers then start as new processes, as without one
                sys.stderr.write(f"relay: no fork server ({type(e).__name__}: {e}); workers start as new processes\n")

    def _watch_exit(self, o: Owned) -> None:
        """Learn of ``o``'s exit: a pidfd, else polling (a process this runtime started)."""
        try:
            o.pidfd = os.pidfd_open(o.popen.pid)
            self._loop.add_reader(o.pidfd, self._on_exit, o.ref.proc_id)
        except (AttributeError, OSError):
            self._loop.create_task(self._poll_exit(o.ref.proc_id))

    def _forked_event(self, proc_id: str) -> None:
        """The fork server reported a worker's exit, or started it as a new process instead
        (then watched as one)."""
        o = self._owned.get(proc_id)
        if o is None:
            return
        if getattr(o.popen, "_fallback", None) is not None and o.pidfd < 0:
            o.ref.pid = o.popen.pid
            self._watch_exit(o)
        self._on_exit(proc_id)

    def on_started(self, msg: Started) -> None:
        o = self._owned.get(msg.proc_id)
        if o is not None and not o.hello.done():
            o.ref.pid, o.ref.host, o.ref.addr = msg.pid, msg.host, msg.addr
            o.hello.set_result(None)

    # ---- exits --------------------------------------------------------------------------

    async def _poll_exit(self, proc_id: str) -> None:
        o = self._owned[proc_id]
        while o.popen.poll() is None and not self._rt.closed:
            await asyncio.sleep(0.05)
        self._on_exit(proc_id)

    def _close_pidfd(self, o: Owned) -> None:
        if o.pidfd >= 0:
            remove_reader(self._loop, o.pidfd)
            os.close(o.pidfd)
            o.pidfd = -1

    def _on_exit(self, proc_id: str) -> None:
        o = self._owned.get(proc_id)
        if o is None or o.exited.done():
            return
        code = o.popen.poll()
        if code is None:
            return
        self._close_pidfd(o)
        if self._hb is not None:
            self._hb.unwatch(proc_id)
        o.exited.set_result(code)
        if o.stopping:
            self._rt.calls.mark_dead(o.ref.addr, stopped(o.ref.addr, "stopped", o.ref))
            return
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            failure = failure_of(o.ref, "signal", f"was killed by signal {name}")
        else:
            failure = failure_of(o.ref, "exit", f"exited with code {code}")
        self._proc_failed(o, failure)

    def _proc_failed(self, o: Owned, failure: MeshFailure) -> None:
        if not o.hello.done():
            o.hello.set_exception(SupervisionError(failure))
            o.hello.exception()  # retrieved: a failed start is reported through supervision
        self._rt.calls.mark_dead(o.ref.addr, failure)
        self.deliver_failure(o.owner_actor, failure)

    # ---- heartbeats ---------------------------------------------------------------------

    def ensure_monitor(self) -> str:
        """Start the heartbeat monitor (once); return the address processes beat to."""
        if self._hb is None:
            address = self._monitor_address()
            self._hb = HeartbeatMonitor(self._rt.transport.ctx, address, self._heartbeat_lost_threadsafe)
            self._hb.start()
        return self._hb.address

    def _monitor_address(self) -> str:
        cfg = self._rt.settings
        if cfg.listen_tcp:
            with socket.socket() as s:  # a free port on this host's address
                s.bind((cfg.host, 0))
                port = s.getsockname()[1]
            return f"tcp://{cfg.host}:{port}"
        return f"ipc://{self._rt.transport.ipc_dir()}/hb"

    def watch_remote(self, ref: ProcRef, owner_actor: str = "") -> None:
        """Supervise a process this runtime did not spawn (e.g. a node agent started by
        torchrun) through its heartbeats: silence for the timeout is a failure."""
        self.ensure_monitor()
        self._remote[ref.proc_id] = (ref, owner_actor)
        self._hb.watch(ref.proc_id, grace=STARTUP_GRACE / 4)  # it is running already

    def unwatch_remote(self, proc_id: str) -> None:
        if self._remote.pop(proc_id, None) is not None and self._hb is not None:
            self._hb.unwatch(proc_id)

    def _heartbeat_lost_threadsafe(self, proc_id: str, why: str) -> None:
        try:
            self._loop.call_soon_threadsafe(self._heartbeat_lost, proc_id, why)
        except RuntimeError:
            pass  # loop closed

    def _heartbeat_lost(self, proc_id: str, why: str) -> None:
        remote = self._remote.pop(proc_id, None)
        if remote is not None:
            ref, owner_actor = remote
            failure = failure_of(ref, "heartbeat", why)
            self._rt.calls.mark_dead(ref.addr, failure)
            self.deliver_failure(owner_actor, failure)
            return
        o = self._owned.get(proc_id)
        if o is None or o.exited.done() or o.stopping:
            return
        o.stopping = True  # its exit (we kill it below) is not a second failure
        failure = failure_of(o.ref, "heartbeat", f"{why}; killed it")
        try:
            o.popen.kill()
        except ProcessLookupError:
            pass
        self._proc_failed(o, failure)

    # ---- failure routing ----------------------------------------------------------------

    def on_failure_event(self, owner_actor: str, failure: MeshFailure) -> None:
        """A failure reported by another process (a failed actor, or a process that a node
        agent watched for us): fail what we have in flight there, then supervise."""
        if failure.addr and failure.kind != "actor":
            self._rt.calls.mark_dead(failure.addr, failure)
        self.deliver_failure(owner_actor, failure)

    def deliver_failure(self, owner_actor: str, failure: MeshFailure) -> None:
        """Hand a failure to the owning actor's __supervise__, or to the fault hook at the root."""
        if not self._rt.actors.supervise(owner_actor, failure):
            _fault_hook(failure)

    # ---- stopping -----------------------------------------------------------------------

    async def stop_procs(self, refs: list[ProcRef], timeout: float) -> None:
        """Stop owned processes: ask them to stop, then SIGKILL what is left after ``timeout``."""
        rt = self._rt
        owned = [self._owned[r.proc_id] for r in refs if r.proc_id in self._owned]
        for o in owned:
            o.stopping = True
            if not o.exited.done() and o.hello.done() and o.hello.exception() is None:
                rt.transport.send(rt.transport.peer(o.ref.addr), Stop(rt.calls.next_id()))
            elif not o.exited.done():
                o.popen.terminate()
        waits = [o.exited for o in owned if not o.exited.done()]
        if waits:
            done, left = await asyncio.wait(waits, timeout=timeout)
            if left:
                for o in owned:
                    if not o.exited.done():
                        o.popen.kill()
                await asyncio.wait(left, timeout=5)
        for o in owned:
            rt.calls.mark_dead(o.ref.addr, stopped(o.ref.addr, "stopped", o.ref))

    def kill_all(self) -> None:
        """Kill every owned process now (SIGKILL) and reap it. Safe from any thread or hook."""
        if self._fork is not None:
            self._fork.kill()  # no more forks; a worker it forked meanwhile exits with it
        for o in list(self._owned.values()):
            o.stopping = True
            if o.popen.poll() is None:
                try:
                    o.popen.kill()
                except ProcessLookupError:
                    pass
        for o in list(self._owned.values()):
            try:
                o.popen.wait(timeout=5)
            except Exception:
                pass

    def close(self) -> None:
        if self._fork is not None:
            self._fork.close()
        if self._hb is not None:
            self._hb.stop()
        for o in self._owned.values():
            self._close_pidfd(o)
