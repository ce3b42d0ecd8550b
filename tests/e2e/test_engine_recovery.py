"""`relay train --use-fault-tolerance` survives the death of an engine worker: the dead
engine is built anew (a rollout engine with the trainer's current weights), the step goes
on, every trained batch is fully judged, and the run's metrics equal an uninterrupted run's.

Layout (dedicated pools, 4 virtual bundles): the trainer on bundle 0, rollout engines on
bundles 1 and 2, the judge's one engine on bundle 3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.test_grpo_modes import ROOT, records, train_cmd
from tests.helpers import live_pids_by_env, reap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600, func_only=True)]
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")
STEPS = 6
LAYOUT = ["--fully-async", "false", "--resource", json.dumps({"actor": [1, 1], "rollout": [1, 2], "genrm": [1, 1]}),
          "--num-rollout", str(STEPS), "--use-fault-tolerance"]
ROLLOUT_BUNDLE, JUDGE_BUNDLE = 2, 3


def _relay_train(data: dict, run_dir: str) -> subprocess.Popen:
    cmd = [RELAY, *train_cmd("tiny-cpu-async", data, run_dir, *LAYOUT)[3:]]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, RELAY_CACHE=data["cache"]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _job_pids(run_dir: str) -> dict[int, int]:
    """{bundle: pid} of the live workers of the job writing to ``run_dir``."""
    return {int(env[b"RELAY_BUNDLE"]): pid for pid, env in live_pids_by_env().items()
            if env.get(b"RELAY_JOB_RUN_DIR") == run_dir.encode() and b"RELAY_BUNDLE" in env}


def _steps_logged(run_dir: str) -> int:
    try:
        return len(records(run_dir))
    except (OSError, json.JSONDecodeError):
        return 0


@pytest.fixture(scope="module")
def uninterrupted(trained, tmp_path_factory) -> list[dict]:
    """The same job with no failure: its step records."""
    run_dir = str(tmp_path_factory.mktemp("uninterrupted") / "run")
    p = _relay_train(trained, run_dir)
    try:
        out, err = p.communicate(timeout=400)
    finally:
        reap([p])
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    return records(run_dir)


@pytest.mark.parametrize("bundle", [ROLLOUT_BUNDLE, JUDGE_BUNDLE], ids=["rollout-engine", "judge-engine"])
def test_a_killed_engine_worker_is_rebuilt_and_the_run_matches_an_uninterrupted_one(data, uninterrupted, bundle,
                                                                                     tmp_path):
    run_dir = str(tmp_path / "run")
    p = _relay_train(data, run_dir)
    try:
        deadline = time.monotonic() + 300
        while _steps_logged(run_dir) < 2:  # steps 0 and 1 are done
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        workers = _job_pids(run_dir)
        assert sorted(workers) == [0, 1, 2, 3], workers
        os.kill(workers[bundle], signal.SIGKILL)
        out, err = p.communicate(timeout=400)
    finally:
        reap([p])
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    assert "shut down cleanly" in out
    role = "rollout" if bundle == ROLLOUT_BUNDLE else "genrm"
    assert f"relay: bundle {bundle} on node 0 ({role} engines) died: was killed by signal SIGKILL" in out, out
    assert f"relay: bundle {bundle}: 1 engine(s) back in" in out, out
    got = records(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r in got:
        # every trained sample's reward is a verdict the judge wrote
        assert r["reward/judged"] == r["samples"] == 32, r
    # after the run, once the rebuild is done: the rebuilt rollout engine has the trainer's
    # weights, with the same version and greedy answer (token, log-prob) as the survivor
    (recovery,) = records(run_dir, "recovery")
    assert recovery["engines/rebuilt"] == 1 and recovery["engines/down"] == [], recovery
    assert recovery["sync/engine_versions"] == [STEPS, STEPS] == recovery["sync/probe_versions"]
    assert recovery["sync/probe_tokens"][0] == recovery["sync/probe_tokens"][1]
    assert recovery["sync/probe_logprobs"][0] == pytest.approx(recovery["sync/probe_logprobs"][1], abs=1e-5)
    assert recovery["sync/probe_logprobs"] == pytest.approx(uninterrupted[-1]["sync/probe_logprobs"], abs=1e-5)
    for a, b in zip(got, uninterrupted):
        assert a["reward/mean"] == b["reward/mean"] and a["samples"] == b["samples"], (a["step"], a, b)
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)
        # the engines that served (one of them while the other was rebuilt) have the weights
        # of the uninterrupted run
        expected = b["sync/probe_logprobs"][0]
        assert b["sync/probe_logprobs"] == pytest.approx([expected] * 2, abs=1e-5)
        assert a["sync/probe_logprobs"] == pytest.approx([expected] * len(a["sync/probe_logprobs"]), abs=1e-5)
    time.sleep(0.5)
    assert _job_pids(run_dir) == {}  # no worker left behind


def test_a_tensor_parallel_engine_is_rebuilt_whole_when_one_of_its_ranks_dies(data, uninterrupted, tmp_path):
    """The rollout's one engine spans bundles 1 and 2 (``--rollout-num-gpus-per-engine 2``):
    its follower rank's worker (bundle 2) is killed after step 1. Rank 0's process exits too
    (its group is broken), both bundles' workers are started again, the engine is built
    anew over them with the trainer's current weights, and the run (generation waits for
    it) ends as the uninterrupted one with one-GPU engines does."""
    run_dir = str(tmp_path / "run")
    cmd = [RELAY, *train_cmd("tiny-cpu-async", data, run_dir, *LAYOUT, "--rollout-num-gpus-per-engine", "2")[3:]]
    p = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, RELAY_CACHE=data["cache"]), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while _steps_logged(run_dir) < 2:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        workers = _job_pids(run_dir)
        os.kill(workers[2], signal.SIGKILL)
        out, err = p.communicate(timeout=400)
    finally:
        reap([p])
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    assert "started 1 rollout engine(s)" in out and "shut down cleanly" in out
    assert "relay: bundle 2 on node 0 (rollout engines) died: was killed by signal SIGKILL" in out, out
    assert "(with bundles [1]: the same engine)" in out and "relay: bundle 2: 1 engine(s) back in" in out, out
    got = records(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert all(r["reward/judged"] == r["samples"] == 32 for r in got)
    (recovery,) = records(run_dir, "recovery")
    assert recovery["engines/rebuilt"] == 1 and recovery["engines/down"] == [], recovery
    assert recovery["sync/engine_versions"] == [STEPS] == recovery["sync/probe_versions"]
    # the rebuilt engine holds the trainer's weights: the same greedy answer as the uninterrupted run's engines
    assert recovery["sync/probe_logprobs"][0] == pytest.approx(uninterrupted[-1]["sync/probe_logprobs"][0], abs=1e-4)
    for a, b in zip(got, uninterrupted):
        assert a["reward/mean"] == b["reward/mean"], (a["step"], a, b)
    time.sleep(0.5)
    assert _job_pids(run_dir) == {}
