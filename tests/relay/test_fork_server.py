"""The fork server (relay.prefork, relay/_forkserver.py, relay/_zygote.py): workers forked
from a process that imported modules once behave as workers started as new processes:
their own environment and directory, the same failures on a real exit or SIGKILL, nothing
left behind on stop or when their spawner is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import relay
from relay import SupervisionError, this_host
from tests.helpers import ended, kill_root_and_tagged, run
from tests.relay.actors import Faulty, Probe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRELOADED = "wave"  # nothing else in a worker imports it


def test_forked_workers_start_with_the_preload_their_own_env_and_directory(tmp_path, monkeypatch):
    async def main():
        relay.prefork([PRELOADED, "json:dumps"])  # "module:function" calls it (dumps() raises: reported, skipped)
        server = relay._runtime.current_runtime().procs._fork
        monkeypatch.chdir(tmp_path)
        procs = this_host().spawn_procs(per_host={"gpus": 2}, env=lambda p: {"PROBE": f"w{p.coords['gpus']}"})
        infos = (await procs.spawn("p", Probe).info.call([PRELOADED], "PROBE").result(60)).values()
        pids = [i["pid"] for i in infos]
        await procs.stop()
        return server.pid, infos, pids

    server, infos, pids = run(main())
    assert [i["ppid"] for i in infos] == [server, server]  # forked by the server
    assert [i["modules"] for i in infos] == [[True], [True]]  # already imported
    assert [i["var"] for i in infos] == ["w0", "w1"]
    assert {i["cwd"] for i in infos} == {str(tmp_path)}
    assert [i["libc_var"] for i in infos] == ["w0", "w1"]  # C code's getenv sees it too
    time.sleep(0.3)
    assert all(ended(p) for p in pids)  # stopped and reaped


def test_a_forked_worker_shows_its_own_command_line_and_environment_in_proc():
    """ps, pkill -f and tools that find a job's processes by a variable read /proc/PID/cmdline
    and /proc/PID/environ: a forked worker's are its own, not the fork server's."""
    async def main():
        relay.prefork([PRELOADED])
        procs = this_host().spawn_procs(per_host={"gpus": 2}, env=lambda p: {"PROBE": f"w{p.coords['gpus']}" * 500})
        infos = list((await procs.spawn("p", Probe).info.call([], "PROBE").result(60)).values())
        shown = []
        for info in infos:
            with open(f"/proc/{info['pid']}/environ", "rb") as f:
                environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if kv)
            with open(f"/proc/{info['pid']}/cmdline", "rb") as f:
                cmdline = [a for a in f.read().split(b"\0") if a]
            shown.append((info, environ, cmdline))
        await procs.stop()
        return shown

    for info, environ, cmdline in run(main()):
        assert environ.pop(b"RELAY_ENVIRON_ROOM").strip(b"x") == b""  # the padding that fills the area
        assert environ == {os.fsencode(k): os.fsencode(v) for k, v in info["environ"].items()}
        assert environ[b"PROBE"] == info["var"].encode() and b"RELAY_PRELOAD" not in environ  # not the server's
        assert cmdline == [sys.executable.encode(), b"-m", b"relay._worker"]
        assert info["libc_var"] == info["var"]


def test_a_forked_worker_whose_environment_does_not_fit_still_runs_with_it(capfd):
    async def main():
        relay.prefork([PRELOADED])
        big = {"BIG1": "y" * 100_000, "BIG2": "z" * 100_000}  # more than the room the server reserves
        procs = this_host().spawn_procs(per_host={"gpus": 1}, env=lambda p: big)
        info = await procs.spawn("p", Probe).info.call_one([PRELOADED], "BIG2").result(60)
        await procs.stop()
        return info

    info = run(main())
    assert info["modules"] == [True] and info["var"] == info["libc_var"] == "z" * 100_000
    assert "relay fork server: the environment" in capfd.readouterr().err  # said, not fatal


def test_the_fork_server_outlives_the_signals_a_scheduler_sends_the_process_group():
    """slurm sends SIGTERM (and SIGUSR1) to every process of the job before a preemption: the
    fork server ignores them (its spawner decides), so its workers, which watch their parent,
    go on; a forked worker gets the signals as a new process would."""
    async def main():
        relay.prefork([PRELOADED])
        server = relay._runtime.current_runtime().procs._fork
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        probe = procs.spawn("p", Probe)
        first = await probe.info.call_one([], "X").result(60)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            os.kill(server.pid, sig)
        await asyncio.sleep(1.0)
        again = await probe.info.call_one([], "X").result(30)
        alive = server.popen.poll() is None
        with open(f"/proc/{first['pid']}/status") as f:
            ignored = int(next(ln for ln in f if ln.startswith("SigIgn:")).split()[1], 16)
        await procs.stop()
        return alive, first, again, ignored

    alive, first, again, ignored = run(main())
    assert alive and again["pid"] == first["pid"]  # both alive
    assert not ignored & (1 << (signal.SIGUSR1 - 1))  # not inherited by the worker


@pytest.mark.parametrize("fault,expected", [(("exit_with", 3), "exited with code 3"),
                                            (("kill_self", signal.SIGKILL), "killed by signal SIGKILL")],
                         ids=["os._exit(3)", "SIGKILL"])
def test_a_forked_worker_dies_with_the_same_failure(faults, fault, expected):
    async def main():
        relay.prefork([PRELOADED])
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("faulty", Faulty)
        victim = mesh.slice(gpus=0)
        method, *args = fault
        with pytest.raises(SupervisionError, match=expected):
            await getattr(victim, method).call_one(*args).result(timeout=30)
        with pytest.raises(SupervisionError, match=expected):  # later callers, at once
            await victim.ok.call_one().result(timeout=5)
        assert await mesh.slice(gpus=1).ok.call_one() == "ok"
        await procs.stop()

    run(main())
    assert len(faults) == 1 and expected in str(faults[0])


def test_without_its_fork_server_a_worker_starts_as_a_new_process(faults):
    async def main():
        relay.prefork([PRELOADED])
        rt = relay._runtime.current_runtime()
        first = this_host().spawn_procs(per_host={"gpus": 1})
        server = rt.procs._fork.pid
        assert (await first.spawn("p", Probe).info.call_one([], "X").result(60))["ppid"] == server
        os.kill(server, signal.SIGKILL)  # its worker exits with it (its parent is gone)
        deadline = time.monotonic() + 10
        while rt.procs._fork.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        later = this_host().spawn_procs(per_host={"gpus": 1})
        info = await later.spawn("p", Probe).info.call_one([PRELOADED], "X").result(60)
        await later.stop()
        await first.stop()
        return info

    info = run(main())
    assert info["ppid"] == os.getpid() and info["modules"] == [False]  # a new process of ours
    assert len(faults) == 1  # the forked worker, gone with its server


def test_a_fork_server_with_threads_does_not_fork_and_workers_start_as_new_processes(capfd):
    """Forking a threaded process can deadlock the child: the server refuses, says why, and
    the worker starts as a new process."""
    async def main():
        relay.prefork(["tests.relay.starts_a_thread"])
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        info = await procs.spawn("p", Probe).info.call_one(["tests.relay.starts_a_thread"], "X").result(60)
        await procs.stop()
        return info

    info = run(main())
    assert info["ppid"] == os.getpid() and info["modules"] == [False]
    assert "threads; it forks only with one" in capfd.readouterr().err


def test_the_fork_server_and_its_workers_exit_when_the_spawner_is_killed():
    code = (
        "import asyncio, os, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "import relay\n"
        "from relay import this_host\n"
        "from tests.relay.actors import Probe\n"
    ) + textwrap.dedent(
        f"""
        async def main():
            relay.prefork([{PRELOADED!r}])
            procs = this_host().spawn_procs(per_host={{"gpus": 2}})
            infos = (await procs.spawn("p", Probe).info.call([], "X").result(60)).values()
            print("pids", [i["ppid"] for i in infos][:1] + [i["pid"] for i in infos], flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
        """
    )
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = eval(root.stdout.readline().split("pids", 1)[1])
        assert len(pids) == 3 and not any(ended(p) for p in pids)
        root.kill()
        root.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not all(ended(p) for p in pids):
            time.sleep(0.01)
        assert all(ended(p) for p in pids), "the fork server or a worker survived its spawner"
    finally:
        kill_root_and_tagged(root)
