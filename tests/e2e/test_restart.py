"""--use-fault-tolerance through GRPO: a killed controller, trainer worker or node agent costs
the steps since the last checkpoint and nothing else: the job restarts from that checkpoint,
finishes every step, and each step's metrics equal those of the same job run without a kill."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from launcher.exitcodes import EXIT_CHECKPOINTED_ON_SIGNAL
from tests.e2e.test_grpo_modes import ROOT, records, train_cmd
from tests.e2e.test_multinode import TORCHRUN, _is_agent, free_port
from tests.helpers import children, parent, reap, tagged_pids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(500, func_only=True)]
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")
FT = ("--save-interval", "1", "--use-fault-tolerance")


def env_of(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().decode(errors="replace").split("\0")
    except OSError:
        return {}
    return dict(item.partition("=")[::2] for item in items if "=" in item)


def only(pids: list[int]) -> int | None:
    assert len(pids) <= 1, pids
    return pids[0] if pids else None


def wait_for(find, procs: list[subprocess.Popen], timeout: float = 300):
    """Until ``find()`` returns something; fails if a process exits first."""
    deadline = time.monotonic() + timeout
    while (found := find()) is None:
        assert time.monotonic() < deadline, "timed out"
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        time.sleep(0.05)
    return found


def wait_for_checkpoint(run_dir: str, step: int, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    """Until checkpoint ``step`` is complete; fails if a process exits first."""
    marker = os.path.join(run_dir, "checkpoints", f"step_{step:06d}", "state.json")
    deadline = time.monotonic() + timeout
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, f"no checkpoint {marker}"
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        time.sleep(0.01)


def final_records(run_dir: str) -> dict[int, dict]:
    """Each step's last record: a step the kill interrupted was recorded again after the restart."""
    return {r["step"]: r for r in records(run_dir)}


def assert_same_metrics(got: dict[int, dict], expected: list[dict]) -> None:
    """The metrics the resume and 2-node tests compare, step by step."""
    assert sorted(got) == [r["step"] for r in expected]
    for b in expected:
        a = got[b["step"]]
        assert a["reward/mean"] == b["reward/mean"] and a["samples"] == b["samples"], (a, b)
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6), (a, b)
        assert a["sync/probe_logprobs"] == pytest.approx(b["sync/probe_logprobs"], rel=1e-4, abs=1e-5), (a, b)


def relay_train(data: dict, run_dir: str, log_dir, *extra: str) -> subprocess.Popen:
    """``relay train`` (the console script) of the e2e Split job; its output to files."""
    cmd = [RELAY, *train_cmd("tiny-cpu-split", data, run_dir, *extra)[3:]]  # from "train" on
    env = dict(os.environ, RELAY_CACHE=data["cache"])
    with open(log_dir / "stdout.txt", "w") as out, open(log_dir / "stderr.txt", "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, env=env)


def outputs(log_dir) -> tuple[str, str]:
    return (log_dir / "stdout.txt").read_text(), (log_dir / "stderr.txt").read_text()


def kill_after_first_checkpoint(data, split_run, tmp_path, choose_victim) -> tuple[str, str, str, int]:
    """Run the job with fault tolerance; once checkpoint 1 is complete (step 2 in progress),
    kill -9 the process ``choose_victim(supervisor_pid)`` names; wait for the end."""
    run_dir = str(tmp_path / "run")
    p = relay_train(data, run_dir, tmp_path, *FT)
    try:
        victim = wait_for(lambda: choose_victim(p.pid), [p])  # found first: the kill follows the checkpoint at once
        wait_for_checkpoint(run_dir, 1, [p])
        assert not os.path.exists(os.path.join(run_dir, "checkpoints", "step_000002")), "step 2 was already done"
        os.kill(victim, signal.SIGKILL)
        p.wait(400)
    finally:
        reap([p])
    out, err = outputs(tmp_path)
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    checkpoints = os.path.join(run_dir, "checkpoints")
    resumed = f"resumed from {checkpoints}/step_000001 (after step 1): continuing with step 2"
    assert out.count("shut down cleanly") == 1 and resumed in out
    assert_same_metrics(final_records(run_dir), records(split_run))
    return run_dir, out, err, victim


def the_controller(supervisor: int) -> int | None:
    """The job process of the first run: the supervisor's only child."""
    pid = only([p for p in tagged_pids(os.environ["RELAY_TEST_TAG"]) if parent(p) == supervisor])
    assert pid is None or env_of(pid).get("RELAY_JOB_GENERATION") == "1"
    return pid


def a_trainer_worker(supervisor: int) -> int | None:
    """The worker of bundle 3 (roles: actor, genrm): a trainer shard."""
    return only([p for p in tagged_pids(os.environ["RELAY_TEST_TAG"]) if env_of(p).get("RELAY_BUNDLE") == "3"])


def test_a_killed_controller_restarts_from_the_last_checkpoint_with_the_same_metrics(data, split_run, tmp_path):
    run_dir, out, err, _ = kill_after_first_checkpoint(data, split_run, tmp_path, the_controller)
    checkpoints = os.path.join(run_dir, "checkpoints")
    assert f"relay: the job failed (signal SIGKILL); restart 1 of 3 from the last checkpoint in {checkpoints}\n" in err
    assert err.count("relay: the job failed") == 1, err[-3000:]


def test_a_killed_trainer_worker_restarts_from_the_last_checkpoint_with_the_same_metrics(data, split_run, tmp_path):
    run_dir, out, err, worker = kill_after_first_checkpoint(data, split_run, tmp_path, a_trainer_worker)
    checkpoints = os.path.join(run_dir, "checkpoints")
    assert (
        f"the worker of bundle 3 (roles: actor, genrm[__default__]; pid {worker}) was killed by signal SIGKILL" in err
    )
    assert f"relay: the job failed (exit 1); restart 1 of 3 from the last checkpoint in {checkpoints}\n" in err
    assert err.count("relay: the job failed") == 1, err[-3000:]


def test_sigterm_to_relay_train_checkpoints_and_stops_without_a_restart(data, tmp_path):
    """Slurm's preemption warning under the supervisor: forwarded to the job, which finishes
    the step, writes a checkpoint and exits 75; not a failure, so no restart."""
    run_dir = str(tmp_path / "run")
    p = relay_train(data, run_dir, tmp_path, *FT, "--num-rollout", "50")
    try:
        wait_for_checkpoint(run_dir, 1, [p])
        p.send_signal(signal.SIGTERM)
        p.wait(120)
    finally:
        reap([p])
    out, err = outputs(tmp_path)
    assert p.returncode == EXIT_CHECKPOINTED_ON_SIGNAL, err[-3000:]
    assert "relay: SIGTERM: writing a checkpoint after the step in progress" in err
    assert "the job failed" not in err and "relay: restart" not in out
    assert len(records(run_dir)) < 50


def torchrun_two_nodes(data: dict, run_dir: str, rdzv_id: str, *extra: str) -> list[subprocess.Popen]:
    """As tests/e2e/test_multinode.py starts the e2e job on 2 "nodes" (127.0.0.2, 127.0.0.3;
    the first hosts the store and gets rank 0), with torchrun --max-restarts 3."""
    args = train_cmd("tiny-cpu-split", data, run_dir, *extra)[4:]  # after "python -m launcher.cli train"
    port = free_port("127.0.0.2")
    nodes = []
    for host in ("127.0.0.2", "127.0.0.3"):
        env = dict(os.environ, RELAY_CACHE=data["cache"], RELAY_HOST=host)
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d"]
        cmd += ["--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", rdzv_id, "-m", "launcher", *args]
        with open(f"{run_dir}-{host}.out", "w") as out, open(f"{run_dir}-{host}.err", "w") as err:
            nodes.append(subprocess.Popen([*cmd, "--gpus-per-node", "2"], cwd=ROOT, stdout=out, stderr=err, env=env))
        deadline = time.monotonic() + 60
        while len(nodes) == 1 and time.monotonic() < deadline and nodes[0].poll() is None:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.2", port)) == 0:
                    break
            time.sleep(0.05)
    return nodes


def test_a_killed_node_agent_under_torchrun_restarts_both_nodes_from_the_last_checkpoint(data, split_run, tmp_path):
    run_dir = str(tmp_path / "run")
    nodes = torchrun_two_nodes(data, run_dir, "ft-kill-agent", *FT)
    try:
        agent = wait_for(
            lambda: only([p for p in tagged_pids(os.environ["RELAY_TEST_TAG"]) if _is_agent(p, "1")]), nodes
        )
        wait_for_checkpoint(run_dir, 1, nodes)
        os.kill(agent, signal.SIGSTOP)  # the agent and its workers frozen: step 1 (0.2 s) cannot finish
        workers = children(agent)
        for w in workers:
            os.kill(w, signal.SIGSTOP)
        assert workers, "the agent hosts no workers"
        assert not os.path.exists(os.path.join(run_dir, "checkpoints", "step_000002")), "step 2 was already done"
        os.kill(agent, signal.SIGKILL)
        for w in workers:  # orphaned: each exits as soon as it runs (its parent's pidfd is readable)
            os.kill(w, signal.SIGCONT)
        for n in nodes:
            n.wait(400)
    finally:
        reap(nodes)
    logs = {
        h: (open(f"{run_dir}-{h}.out").read(), open(f"{run_dir}-{h}.err").read()) for h in ("127.0.0.2", "127.0.0.3")
    }
    assert [n.returncode for n in nodes] == [0, 0], {h: e[-3000:] for h, (_, e) in logs.items()}
    out = "".join(o for o, _ in logs.values())  # the second run's controller may be on either node
    checkpoints = os.path.join(run_dir, "checkpoints")
    assert out.count("relay: restart 1 of 3: resuming from the newest complete checkpoint") == 1, out[-3000:]
    resumed = f"resumed from {checkpoints}/step_000001 (after step 1): continuing with step 2"
    assert resumed in out and out.count("shut down cleanly") == 1
    assert_same_metrics(final_records(run_dir), records(split_run))
