"""User paths through the GRPO loop that the happy-path tests missed: eval data next to
train data, a preemption signal and a resume, Defer-swap evaluation, the fully-async bound,
a reward that raises. Each runs ``relay train`` for real and reads what the run wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e.test_grpo_modes import ROOT, records, run_train, train_cmd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400, func_only=True)]


def write_rows(path, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def questions(path: str) -> dict[str, str]:
    """question text -> label of a data file."""
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            q = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]
            out[q] = r["label"]
    return out


def test_every_sample_is_generated_from_its_own_rows_prompt_across_eval_signal_and_resume(data, tmp_path, monkeypatch):
    """A custom reward records each sample's prompt text, label and the prompt the policy was
    really given. Run 1 evaluates before training and after steps 3 and 4 (the last step,
    though not a multiple of --eval-interval), and is stopped by SIGTERM: it finishes the
    step, writes a checkpoint and exits 75. Run 2 resumes (no eval before training). Every
    sample's prompt is its own row's; checkpoints beyond --keep-checkpoints are gone."""
    eval_path = write_rows(
        tmp_path / "eval.jsonl", [{"prompt": f"What is {n} mod 10?", "label": str(n % 10)} for n in range(77701, 77707)]
    )
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("RELAY_TEST_RECORD", str(record))
    run_dir = str(tmp_path / "run")
    extra = (
        "--custom-rm-path",
        "tests.e2e.recording_reward.record",
        "--eval-prompt-data",
        eval_path,
        "--eval-interval",
        "3",
        "--num-rollout",
        "4",
        "--save-interval",
        "1",
        "--keep-checkpoints",
        "2",
    )
    env = dict(os.environ, RELAY_CACHE=data["cache"])
    p = subprocess.Popen(
        train_cmd("tiny-cpu-split", data, run_dir, *extra),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        deadline = time.monotonic() + 300
        while p.poll() is None and time.monotonic() < deadline and not (os.path.exists(metrics) and records(run_dir)):
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[1][-3000:]
        os.killpg(p.pid, signal.SIGTERM)  # to every process of the job, as slurm does before preemption
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 75, err[-3000:]
    assert "writing a checkpoint after the step in progress" in err and "--resume continues with step" in err
    stopped_after = max(r["step"] for r in records(run_dir))
    assert stopped_after < 3
    with open(os.path.join(run_dir, "checkpoints", f"step_{stopped_after:06d}", "state.json")) as f:
        assert json.load(f)["next_step"] == stopped_after  # steps done: the index of the next

    assert "Warning" not in out + err, "library warnings belong in the workers' log files"
    assert any(
        "Warning" in open(os.path.join(run_dir, "logs", f)).read() for f in os.listdir(os.path.join(run_dir, "logs"))
    )
    out2 = run_train("tiny-cpu-split", data, run_dir, *extra, "--resume", "--skip-eval-before-train", timeout=300)
    assert f"(after step {stopped_after}): continuing with step {stopped_after + 1}" in out2
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4]  # each step once, across the stop
    assert [r["step"] for r in records(run_dir, "eval")] == [0, 3, 4]  # before training, periodic, final
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_000003", "step_000004"]

    train_q, eval_q = questions(data["train"]), questions(eval_path)
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    for s in seen:
        assert s["question"] in s["given"], (
            f"sample of {s['question']!r} was generated from another prompt: {s['given']!r}"
        )
        assert s["label"] == (eval_q.get(s["question"]) or train_q[s["question"]])
    n_eval = sum(s["question"] in eval_q for s in seen)
    assert n_eval == 3 * len(eval_q)  # three evaluations, one sample per eval prompt, none mixed into training
    assert len(seen) - n_eval == 4 * 4 * 8  # four steps of 4 prompts x 8 samples


def test_defer_swap_evaluates_an_eval_set_that_is_not_whole_training_groups(data, tmp_path):
    """The shipped post-process hook groups an eval batch by the eval's k, not by the
    training group size (5 eval rows, 8 samples per training prompt)."""
    eval_path = write_rows(
        tmp_path / "eval.jsonl", [{"prompt": f"What is {n} mod 10?", "label": str(n % 10)} for n in range(501, 506)]
    )
    run_dir = str(tmp_path / "run")
    run_train("tiny-cpu-defer", data, run_dir, "--num-rollout", "1", "--eval-prompt-data", eval_path)
    evals = records(run_dir, "eval")
    assert [e["step"] for e in evals] == [0, 1] and all(e["eval/samples"] == 5 for e in evals)


def test_fully_async_bounds_in_flight_groups_and_counts_all_judge_work(data, tmp_path):
    run_dir = str(tmp_path / "run")
    run_train("tiny-cpu-async", data, run_dir, "--max-staleness", "1", "--num-rollout", "4")
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    bound = (1 + 1) * 4
    for r in recs:
        assert r["rollout/groups_in_flight_bound"] == bound
        assert 0 < r["rollout/groups_in_flight_max"] <= bound
        assert r["rollout/staleness_max"] <= 1
        assert r["time/reward"] > 0
    (summary,) = records(run_dir, "summary")
    assert summary["rollout/groups_dropped"] <= 0.1 * summary["rollout/groups_generated"], summary
    assert sum(r["rollout/stale_groups_dropped"] for r in recs) == summary["rollout/groups_dropped"]
    # every judge request the service counted is in some record (the self-check's in its own)
    (check,) = records(run_dir, "judge_check")
    assert check["judge/requests"] == check["judge/self_check_total/__default__"] == 25
    counted = check["judge/requests"] + sum(r["judge/requests"] for r in recs) + summary["judge/requests"]
    assert counted == summary["judge/requests_total"] > 0


def test_a_failing_reward_names_itself_and_the_sample(data, tmp_path):
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, RELAY_CACHE=data["cache"])
    p = subprocess.run(
        train_cmd(
            "tiny-cpu-split",
            data,
            run_dir,
            "--num-rollout",
            "1",
            "--custom-rm-path",
            "tests.e2e.recording_reward.bad_route",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 1
    assert (
        "the reward (--custom-rm-path tests.e2e.recording_reward.bad_route) failed on the sample of row" in p.stderr
    ), p.stderr[-3000:]
    assert "no-such-judge" in p.stderr and "label" in p.stderr
