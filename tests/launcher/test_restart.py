"""--use-fault-tolerance: the restart policy of the one-node supervisor (pure), and real
launches on localhost that only place the job (no training; the e2e restarts that resume
training are in tests/e2e/test_restart.py): the supervisor restarts a killed controller at
most --max-global-restart times, signals stop it without a restart, and torchrun must be
launched with --max-restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from launcher.exitcodes import EXIT_CHECKPOINTED_ON_SIGNAL
from launcher.supervisor import after_exit, describe_exit, shell_code
from tests.helpers import parent, reap
from tests.launcher.test_launch import (
    ROOT,
    TORCHRUN,
    _listening,
    free_port,
    procs_with_env,
    read_until,
    wait_for,
)


def _spawner(pid: int) -> int:
    """The process that started worker ``pid``: its parent, or its fork server's parent."""
    up = parent(pid)
    with open(f"/proc/{up}/cmdline", "rb") as f:
        return parent(up) if b"relay._zygote" in f.read() else up


RELAY = os.path.join(os.path.dirname(sys.executable), "relay")
CKPT = "/runs/x/checkpoints"


# ---------------------------------------------------------------------------- the policy (pure)


@pytest.mark.unit
def test_exits_are_described_as_codes_or_signals():
    assert describe_exit(1) == "exit 1"
    assert describe_exit(-9) == "signal SIGKILL"
    assert shell_code(-9) == 137 and shell_code(3) == 3


@pytest.mark.unit
def test_failures_restart_until_the_budget_is_spent_then_stop_with_a_clear_message():
    verdicts = [after_exit(-9, done, 2, signalled=False, checkpoints=CKPT) for done in range(3)]
    assert [v.restart for v in verdicts] == [True, True, False]
    assert verdicts[0].message == (
        f"relay: the job failed (signal SIGKILL); restart 1 of 2 from the last checkpoint in {CKPT}"
    )
    assert verdicts[1].message.startswith("relay: the job failed (signal SIGKILL); restart 2 of 2 ")
    assert "after 2 restart(s)" in verdicts[2].message and "--max-global-restart (2)" in verdicts[2].message
    assert not after_exit(1, 0, 0, signalled=False, checkpoints=CKPT).restart  # --max-global-restart 0


@pytest.mark.unit
@pytest.mark.parametrize("code", [0, 2, 130, 143, EXIT_CHECKPOINTED_ON_SIGNAL])
def test_success_stops_and_bad_command_lines_are_not_restarted(code):
    v = after_exit(code, 0, 3, signalled=False, checkpoints=CKPT)
    assert not v.restart and v.message is None


@pytest.mark.unit
@pytest.mark.parametrize("code", [1, -9, -15])
def test_a_stop_the_user_asked_for_is_never_restarted(code):
    assert not after_exit(code, 0, 3, signalled=True, checkpoints=CKPT).restart


# ---------------------------------------------------------------------------- real launches


def relay_train(run_dir, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [RELAY, "train", "--config", "tiny-cpu-split", "--run-dir", str(run_dir), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def torchrun_with_restarts(port: int, run_id: str, max_restarts: int, *args: str) -> subprocess.Popen:
    """One of 2 "nodes" on 127.0.0.1: ``torchrun --max-restarts N ... -m launcher ARGS``."""
    cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", str(max_restarts)]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
    return subprocess.Popen(
        [*cmd, "-m", "launcher", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def launcher_procs(key: str, value: str) -> list[int]:
    """This test's processes running the launcher itself (not torchrun, not a worker) with env KEY=VALUE."""
    out = []
    for pid in procs_with_env(key, value):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
        if b"launcher" in cmd or b"launcher.cli" in cmd:
            out.append(pid)
    return out


def controller_of(supervisor: int, generation: int) -> int:
    """The job process (the controller) of this generation: the supervisor's child."""
    pids = [p for p in procs_with_env("RELAY_JOB_GENERATION", str(generation)) if parent(p) == supervisor]
    assert len(pids) == 1, pids
    return pids[0]


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_controller_killed_more_often_than_max_global_restart_stops_the_job_with_a_clear_message(tmp_path):
    p = relay_train(tmp_path / "run", "--hold", "120", "--use-fault-tolerance", "--max-global-restart", "1")
    try:
        out = read_until(p, "holding the job", 90)
        first = controller_of(p.pid, 1)
        workers = procs_with_env("RELAY_BUNDLE")
        assert len(workers) == 4
        os.kill(first, signal.SIGKILL)
        out += read_until(p, "holding the job", 90)  # the second generation is up
        assert not set(workers) & set(procs_with_env("RELAY_BUNDLE"))  # the first one's workers are gone
        second = controller_of(p.pid, 2)
        os.kill(second, signal.SIGKILL)
        rest, err = p.communicate(timeout=30)
    finally:
        reap([p])
    assert p.returncode == 128 + signal.SIGKILL, err
    checkpoints = os.path.join(str(tmp_path / "run"), "checkpoints")
    assert (
        f"relay: the job failed (signal SIGKILL); restart 1 of 1 from the last checkpoint in {checkpoints}\n" in err
    ), err
    assert (
        "relay: the job failed (signal SIGKILL) after 1 restart(s), the most --max-global-restart (1) allows; "
        "giving up." in err
    ), err
    assert err.count("relay: the job failed") == 2
    assert "relay: restart 1 of 1: resuming from the newest complete checkpoint" in out + rest
    wait_for(lambda: not procs_with_env("RELAY_BUNDLE"), 10, "workers to exit")


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_supervisor_stops_the_job_without_a_restart(tmp_path, sig, code):
    p = relay_train(tmp_path / "run", "--hold", "120", "--use-health-check")
    try:
        read_until(p, "holding the job", 90)
        controller = controller_of(p.pid, 1)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        reap([p])
    assert p.returncode == code, err
    assert f"stopped by {signal.Signals(sig).name}" in err  # the controller's own stop, forwarded to it
    assert "restart" not in err and not procs_with_env("RELAY_JOB_GENERATION", "2")
    assert not os.path.exists(f"/proc/{controller}")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_without_the_flag_relay_train_runs_the_job_in_its_own_process(tmp_path):
    p = relay_train(tmp_path / "run", "--hold", "120")
    try:
        read_until(p, "holding the job", 90)
        assert not procs_with_env("RELAY_JOB_GENERATION")
        workers = procs_with_env("RELAY_BUNDLE")
        # the relay process's own: its children, or its fork server's (a child of it)
        assert len(workers) == 4 and {_spawner(w) for w in workers} == {p.pid}
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    finally:
        reap([p])
    assert p.returncode == 143


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_torchrun_without_enough_max_restarts_is_refused_naming_the_flag(tmp_path):
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "ft-check", "-m", "launcher"]
    cmd += ["--config", "tiny-cpu-split", "--run-dir", str(tmp_path / "run"), "--use-fault-tolerance"]
    p = subprocess.run(cmd + ["--max-global-restart", "2"], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert p.returncode != 0 and "placed a probe actor" not in p.stdout
    assert (
        "--use-fault-tolerance restarts a torchrun job through torchrun, which was started with --max-restarts 0: "
        "add --max-restarts 2 (at least --max-global-restart) to the torchrun command line on every node" in p.stderr
    ), p.stderr[-3000:]


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", ["1", "0"], ids=["agent", "controller"])
def test_torchrun_restarts_both_nodes_after_a_kill_and_the_new_run_ignores_the_old_keys(tmp_path, victim):
    """Node 1's agent or the controller (rank 0) is killed: the peer exits non-zero, both
    nodes' processes start again (torchrun --max-restarts), count generation 2 in the store
    and meet under generation-2 keys: had the new agent or controller read the first run's
    values (the dead controller's address, the old secret), the second run would not be placed."""
    port = free_port()
    args = ["--config", "tiny-cpu-split", "--gpus-per-node", "2", "--hold", "20", "--run-dir", str(tmp_path / "run")]
    args += ["--use-fault-tolerance", "--max-global-restart", "1"]
    nodes = [torchrun_with_restarts(port, "ft-restart", 1, *args)]
    wait_for(lambda: _listening(port), 30, "the rendezvous store")
    nodes.append(torchrun_with_restarts(port, "ft-restart", 1, *args))
    try:
        wait_for(lambda: len(procs_with_env("RELAY_BUNDLE")) == 4, 90, "4 workers")
        first = set(procs_with_env("RELAY_BUNDLE"))
        target = wait_for(lambda: launcher_procs("GROUP_RANK", victim), 10, f"the rank-{victim} process")[0]
        os.kill(target, signal.SIGKILL)
        outs = [n.communicate(timeout=180) for n in nodes]
    finally:
        reap(nodes)
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-3000:] for o in outs]
    both = "".join(o for o, _ in outs)  # torchrun may give rank 0 to the other node in the second run
    assert both.count("\nlayout: ") + both.startswith("layout: ") == 2, [o[-3000:] for o in outs]  # 2 controllers
    assert both.count("relay: restart 1 of 1: resuming from the newest complete checkpoint") == 1
    second = next(o for o, _ in outs if "restart 1 of 1" in o).split("relay: restart 1 of 1")[1]
    assert "placed a probe actor on every bundle" in second and second.count("shut down cleanly") == 1
    assert not first & set(procs_with_env("RELAY_BUNDLE"))


@pytest.mark.integration
def test_relay_sbatch_launches_torchrun_with_max_restarts_when_the_job_is_fault_tolerant(tmp_path):
    from tests.launcher.test_sbatch import render

    def torchrun_line(*flags: str) -> str:
        p = render(tmp_path, "--config", "tiny-cpu-split", "--nodes", "2", "--gpus-per-node", "2", *flags)
        assert p.returncode == 0, p.stderr
        return next(line for line in p.stdout.splitlines() if line.startswith("torchrun "))

    assert "--max-restarts" not in torchrun_line()
    line = torchrun_line("--use-fault-tolerance", "--max-global-restart", "2")
    assert line.startswith("torchrun --nnodes 2 --nproc-per-node 1 --max-restarts 2 --rdzv-backend c10d"), line
    assert " --max-restarts 3 " in torchrun_line("--use-health-check")  # the default --max-global-restart


@pytest.mark.unit
def test_a_restarted_controller_resumes_and_refuses_to_start_past_the_limit(monkeypatch, tmp_path, capsys):
    """The controller's side of a restart, for torchrun and the supervisor alike: generation
    N > 1 forces --resume; past --max-global-restart it stops, and tells this run's agents."""
    from launcher.config import load_config
    from launcher.controller import JobFailed, _restarted
    from launcher.rendezvous import Rendezvous

    cfg = load_config("tiny-cpu-split", ["--use-fault-tolerance", "--max-global-restart", "1"])
    for generation, resumed in (("1", False), ("2", True)):
        monkeypatch.setenv("RELAY_JOB_GENERATION", generation)
        assert _restarted(cfg, Rendezvous(), str(tmp_path), sys.stdout).resume is resumed
    assert "relay: restart 1 of 1: resuming from the newest complete checkpoint" in capsys.readouterr().out
    monkeypatch.setenv("RELAY_JOB_GENERATION", "3")
    rdzv = Rendezvous()
    with pytest.raises(JobFailed, match=r"the job failed 2 time\(s\), and --max-global-restart 1 allows 1 restart"):
        _restarted(cfg, rdzv, str(tmp_path), sys.stdout)
    assert "not restarting it again" in asyncio.run(rdzv.get("secret", 1))["stop"]  # what its agents read
    plain = load_config("tiny-cpu-split", [])  # without fault tolerance a later generation changes nothing
    assert _restarted(plain, rdzv, str(tmp_path), sys.stdout) is plain


def earlier_run(run_dir) -> str:
    """A complete checkpoint of an earlier run in ``run_dir``."""
    step = run_dir / "checkpoints" / "step_000007"
    step.mkdir(parents=True)
    (step / "state.json").write_text('{"next_step": 8, "weight_version": 8}')
    return str(step)


@pytest.mark.unit
def test_a_first_run_refuses_an_earlier_runs_checkpoints_that_its_restarts_would_resume_from(monkeypatch, tmp_path):
    from launcher.config import load_config
    from launcher.controller import JobFailed, _restarted
    from launcher.rendezvous import Rendezvous

    earlier_run(tmp_path)
    monkeypatch.setenv("RELAY_JOB_GENERATION", "1")
    cfg = load_config("tiny-cpu-split", ["--use-fault-tolerance"])
    with pytest.raises(JobFailed, match=r"already holds checkpoints of an earlier run \(newest: step_000007\)"):
        _restarted(cfg, Rendezvous(), str(tmp_path), sys.stdout)
    resumed = load_config("tiny-cpu-split", ["--use-fault-tolerance", "--resume"])
    assert _restarted(resumed, Rendezvous(), str(tmp_path), sys.stdout) is resumed


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_relay_train_with_fault_tolerance_refuses_a_run_dir_with_an_earlier_runs_checkpoints(tmp_path):
    checkpoints = os.path.dirname(earlier_run(tmp_path / "run"))
    p = relay_train(tmp_path / "run", "--use-fault-tolerance")
    out, err = p.communicate(timeout=50)
    assert p.returncode == 2 and "layout:" not in out
    assert (
        f"relay train: --use-fault-tolerance: {checkpoints} already holds checkpoints of an earlier run (newest: "
        "step_000007), and a restart would resume from them: pass --resume to continue that run, or choose a new "
        "--run-dir\n" in err
    ), err
    p = relay_train(tmp_path / "run", "--use-fault-tolerance", "--resume")  # placement only: nothing to resume
    out, err = p.communicate(timeout=50)
    assert p.returncode == 0 and "shut down cleanly" in out, err


@pytest.mark.unit
def test_rendezvous_generations_in_torchruns_store_count_starts_and_never_see_an_earlier_runs_keys(monkeypatch):
    """What each process does on torchrun's agent store (a real TCPStore, kept across restarts)."""
    import datetime

    from torch.distributed import TCPStore

    from launcher.rendezvous import Rendezvous

    port = free_port()
    server = TCPStore(
        "127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    for k, v in {**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(k, v)

    def start(rank: int) -> Rendezvous:
        monkeypatch.setenv("RANK", str(rank))
        return Rendezvous(timeout=1)

    first = [start(0), start(1)]
    assert [r.generation for r in first] == [1, 1]
    first[0].set("controller", {"addr": "old"})
    assert asyncio.run(first[1].get("controller"))["addr"] == "old"
    second = [start(1), start(0)]  # torchrun may hand out the ranks in another order: each counts its own starts
    assert [r.generation for r in second] == [2, 2]
    with pytest.raises(TimeoutError, match="'controller' was not published"):
        asyncio.run(second[0].get("controller"))  # the first run's value is not this run's
    assert second[1].refused() is None
    second[1].refuse("no more")
    assert asyncio.run(second[0].get("secret")) == {"stop": "no more"}
    assert [start(0).refused(), start(1).refused()] == ["no more", "no more"]  # and every later run refuses
    del server
