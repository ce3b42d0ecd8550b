"""ActorError vs SupervisionError, __supervise__, the root fault hook, heartbeats, and
process hygiene. Faults are real: raise, os._exit, SIGKILL, SIGSEGV, SIGSTOP."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from relay import ActorError, SupervisionError, this_host
from tests.helpers import kill_root_and_tagged, run
from tests.relay.actors import BadInit, Caller, Cleanup, Faulty, Supervisor

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_endpoint_exception_is_actor_error_and_actor_lives_on(faults):
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("faulty", Faulty)
        with pytest.raises(ActorError) as info:
            await mesh.slice(gpus=1).boom.call_one("bad input")
        err = info.value
        assert isinstance(err.exception, ValueError) and str(err.exception) == "bad input"
        assert err.rank == 1 and err.method == "boom" and err.actor == "faulty"
        assert "raise ValueError(message)" in err.remote_traceback  # the remote traceback
        assert (await mesh.ok.call()).values() == ["ok", "ok"]  # still alive
        # call(): the whole call fails with the lowest failed rank's error
        with pytest.raises(ActorError, match="rank 0"):
            await mesh.boom.call("both")
        await procs.stop()
        assert faults == []  # an ActorError is not a supervision event

    run(main())


@pytest.mark.parametrize(
    "fault,expected",
    [
        (("exit_with", 3), "exited with code 3"),
        (("kill_self", signal.SIGKILL), "killed by signal SIGKILL"),
        (("segfault",), "killed by signal SIGSEGV"),
    ],
    ids=["os._exit(3)", "SIGKILL", "SIGSEGV"],
)
def test_dead_process_is_supervision_error_for_pending_and_later_callers(faults, fault, expected):
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("faulty", Faulty)
        victim = mesh.slice(gpus=0)
        pending = victim.hang.call_one(60)  # in flight when the process dies
        await asyncio.sleep(0.2)
        method, *args = fault
        with pytest.raises(SupervisionError, match=expected):
            await getattr(victim, method).call_one(*args).result(timeout=30)
        with pytest.raises(SupervisionError, match=expected):
            await pending.result(timeout=30)
        with pytest.raises(SupervisionError, match=expected):  # later callers, at once
            await victim.ok.call_one().result(timeout=5)
        # The other process is unaffected.
        assert await mesh.slice(gpus=1).ok.call_one() == "ok"
        # The root owns the mesh and has no __supervise__: the fault hook got it.
        assert len(faults) == 1 and expected in str(faults[0]) and faults[0].rank == 0
        assert faults[0].mesh == "procs"
        await procs.stop()

    run(main())


def test_a_caller_that_does_not_own_the_dead_process_learns_of_its_death(faults):
    """Process B calls an actor of process A, which B did not spawn (no pidfd, no
    heartbeats of its own): when A is killed, B's call in flight and B's later calls fail
    with SupervisionError at once (the connection drops), instead of waiting for ever."""

    async def main():
        target_procs = this_host().spawn_procs(per_host={"gpus": 1}, name="target")
        target = target_procs.spawn("faulty", Faulty)
        await target.initialized(30)
        caller_procs = this_host().spawn_procs(per_host={"gpus": 1}, name="caller")
        caller = caller_procs.spawn("caller", Caller, target)
        await caller.initialized(30)
        assert (await caller.call.call_one("ok").result(30))[:2] == ["ok", "ok"]
        pending = caller.call.call_one("hang", 60)
        await asyncio.sleep(0.3)
        os.kill(target_procs.procs[0].pid, signal.SIGKILL)
        in_flight = await pending.result(30)
        later = await caller.call.call_one("ok").result(30)
        pid = target_procs.procs[0].pid
        await caller_procs.stop()
        await target_procs.stop()
        return in_flight, later, pid

    in_flight, later, pid = run(main())
    for outcome, detail, seconds in (in_flight, later):
        assert outcome == "SupervisionError" and "connection lost" in detail and seconds < 5, (outcome, detail, seconds)
        # the caller names the process it lost as an owner would, not as '?' of mesh '?'
        assert "of mesh 'target'" in detail and f"pid {pid}" in detail, detail


def test_missed_heartbeats_are_detected(faults, monkeypatch):
    monkeypatch.setenv("RELAY_HEARTBEAT_INTERVAL", "0.1")
    monkeypatch.setenv("RELAY_HEARTBEAT_TIMEOUT", "1.0")

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        mesh = procs.spawn("faulty", Faulty)
        pid = await mesh.pid.call_one()
        pending = mesh.hang.call_one(60)
        os.kill(pid, signal.SIGSTOP)  # alive but frozen: only heartbeats can tell
        t0 = time.monotonic()
        with pytest.raises(SupervisionError, match="missed heartbeats"):
            await pending.result(timeout=30)
        assert time.monotonic() - t0 < 10
        assert faults and faults[0].kind == "heartbeat"
        await procs.stop()

    run(main())


def test_owner_supervise_hook_handles_child_failure(faults):
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        sup = procs.spawn("sup", Supervisor, True)
        await sup.start_children.call_one(2)
        await sup.kill_child.call_one(1)
        for _ in range(100):
            if await sup.seen.call_one():
                break
            await asyncio.sleep(0.05)
        seen = await sup.seen.call_one()
        assert len(seen) == 1 and "SIGKILL" in seen[0] and "rank 1" in seen[0]
        # Handled: the owner lives on; the root hook saw nothing.
        text = await sup.call_children.call_one()
        assert text.startswith("SupervisionError") and "SIGKILL" in text
        assert faults == []
        await procs.stop()

    run(main())


def test_unhandled_child_failure_propagates_to_the_root(faults):
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        sup = procs.spawn("sup", Supervisor, False)
        await sup.start_children.call_one(1)
        await sup.kill_child.call_one(0)
        for _ in range(100):
            if faults:
                break
            await asyncio.sleep(0.05)
        assert len(faults) == 1
        f = faults[0]
        assert f.kind == "actor" and f.actor == "sup" and "did not handle" in f.reason
        assert "SIGKILL" in f.cause[0]
        with pytest.raises(SupervisionError):  # the owner actor is now failed
            await sup.seen.call_one().result(timeout=10)
        await procs.stop()

    run(main())


def test_broadcast_endpoint_raising_fails_the_actor(faults):
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        sup = procs.spawn("sup", Supervisor, True)
        await sup.start_children.call_one(1)
        await sup.broadcast_boom.call_one()
        for _ in range(100):
            if await sup.seen_kinds.call_one():
                break
            await asyncio.sleep(0.05)
        assert await sup.seen_kinds.call_one() == ["actor"]
        text = await sup.call_children.call_one()
        assert text.startswith("SupervisionError") and "from broadcast" in text
        await procs.stop()

    run(main())


def test_failing_init_is_a_supervision_event(faults):
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        mesh = procs.spawn("bad", BadInit)
        with pytest.raises(ActorError, match="init exploded"):
            await mesh.initialized(timeout=30)
        with pytest.raises(SupervisionError, match="init exploded"):
            await mesh.ok.call_one().result(timeout=10)
        for _ in range(100):
            if faults:
                break
            await asyncio.sleep(0.05)
        assert faults and faults[0].kind == "actor" and faults[0].actor == "bad"
        await procs.stop()

    run(main())


def test_stop_runs_cleanup_and_ends_processes(tmp_path, faults):
    marker = tmp_path / "cleaned"

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("c", Cleanup, str(marker))
        assert (await mesh.ping.call()).values() == ["pong", "pong"]
        pids = [p.pid for p in procs.procs]
        await procs.stop()
        assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in pids)
        with pytest.raises(SupervisionError, match="stopped"):
            await mesh.ping.call().result(timeout=5)
        assert faults == []  # a stop is not a failure

    run(main())
    assert marker.read_text() == "cleaned"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_loop_end_stops_processes_it_owns():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("f", Faulty)
        return (await mesh.pid.call()).values()

    pids = run(main())  # no explicit stop: the end of asyncio.run() stops them
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_zombie(p) for p in pids):
        time.sleep(0.05)
    assert all(_zombie(p) for p in pids)


def _script(body: str) -> str:
    header = (
        "import asyncio, os, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from relay import this_host\n"
        "from tests.relay.actors import Faulty, Spawner\n"
    )
    return header + textwrap.dedent(body)


def test_unhandled_failure_at_root_stops_the_job_with_a_clear_message():
    code = _script(
        """
        async def main():
            procs = this_host().spawn_procs(per_host={"gpus": 2}, name="workers")
            mesh = procs.spawn("f", Faulty)
            print("pids", (await mesh.pid.call()).values(), flush=True)
            mesh.slice(gpus=1).exit_with.broadcast(7)
            await asyncio.sleep(30)
            print("not reached")
        asyncio.run(main())
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "not reached" not in proc.stdout
    assert "unhandled failure, stopping the job" in proc.stderr
    assert "'workers-0.1'" in proc.stderr and "rank 1 of mesh 'workers'" in proc.stderr
    assert "exited with code 7" in proc.stderr
    # and its other worker was killed with it (checked by the no-leftover fixture too)
    pids = eval(proc.stdout.split("pids", 1)[1].strip())
    time.sleep(0.5)
    assert all(_zombie(p) for p in pids)


def test_workers_and_grandchildren_exit_when_the_root_is_killed():
    code = _script(
        """
        async def main():
            procs = this_host().spawn_procs(per_host={"gpus": 1})
            sp = procs.spawn("s", Spawner)
            kids = await sp.spawn_grandchildren.call_one(2)
            print("pids", [await sp.pid.call_one()] + kids, flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
        """
    )
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = root.stdout.readline()
        pids = eval(line.split("pids", 1)[1])
        assert len(pids) == 3 and all(not _zombie(p) for p in pids)
        root.kill()  # no cleanup code runs in the root
        root.wait(10)
        killed = time.monotonic()
        deadline = killed + 15
        while time.monotonic() < deadline and not all(_zombie(p) for p in pids):
            time.sleep(0.01)
        assert all(_zombie(p) for p in pids), "orphans survived their parent"
        # at once (each watches its parent's pidfd), not at their next beats (0.5 s apart, two
        # generations): an orphan must not finish work its dead parent's job gave up
        assert time.monotonic() - killed < 0.45, time.monotonic() - killed
    finally:
        kill_root_and_tagged(root)


def test_many_runtimes_one_after_another_in_one_process():
    """Each asyncio.run() gets a fresh runtime and must leave ZeroMQ's shared context
    healthy for the next (regression: closing a socket monitor's reader before the
    monitored socket wedged libzmq's I/O thread, and later runtimes never connected)."""

    async def once():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("f", Faulty)
        values = (await mesh.ok.call().result(timeout=20)).values()
        await procs.stop()
        return values

    for _ in range(15):
        assert run(once(), 30) == ["ok", "ok"]
