"""Reward code and data written for the original, through ``relay train`` unchanged: a row's
``metadata`` object is ``sample.metadata`` (the documentation's agentic reward reads
``sample.metadata["trajectory_steps"]``), the dataset's ``question`` is the judge's, and the
original's launch-script flags parse with their meaning."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_grpo_modes import records
from tests.e2e.test_training_math import relay_train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400, func_only=True)]

AGENTIC_REWARD = '''
async def reward(args, sample, **kwargs):
    """As the original's documentation writes it: per trajectory step, by its module."""
    steps = sample.metadata["trajectory_steps"]
    assert sample.metadata["question"] == "QUESTION " + sample.label, sample.metadata
    assert "metadata" not in sample.metadata
    return sum(1.0 for step in steps if step["module"] == "final_answer") * float(len(sample.response) % 2)
'''


def test_reward_code_reading_the_rows_metadata_trains(data, tmp_path):
    rows = []
    with open(data["train"]) as f:
        for line in f:
            row = json.loads(line)
            row["metadata"] = {"question": f"QUESTION {row['label']}",
                               "trajectory_steps": [{"module": "planner"}, {"module": "final_answer"}]}
            rows.append(row)
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "agentic.py").write_text(AGENTIC_REWARD)
    run_dir = str(tmp_path / "run")
    relay_train({**data, "train": str(path)}, run_dir, "--custom-rm-path", "agentic.reward",
                "--genrm-skip-self-check", "true", "--rollout-shuffle", "--rollout-seed", "42",
                "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", cwd=str(tmp_path))
    (rec,) = records(run_dir)
    assert rec["samples"] == 32 and 0 < rec["reward/mean"] < 1 and rec["train/grad_norm"] > 0


def test_several_named_eval_sets_each_get_metrics_and_a_console_line(data, tmp_path):
    from tests.e2e.test_training_math import eval_subset

    a, b = eval_subset(data, str(tmp_path / "a.jsonl"), 6), eval_subset(data, str(tmp_path / "b.jsonl"), 10)
    run_dir = str(tmp_path / "run")
    p = relay_train(data, run_dir, "--eval-prompt-data", "aime", a, "math500", b, "--genrm-skip-self-check", "true")
    before, after = records(run_dir, "eval")
    for rec in (before, after):
        assert rec["eval/aime/samples"] == 6 and rec["eval/math500/samples"] == 10
        assert rec["eval/accuracy"] == rec["eval/aime/accuracy"]  # the first set's figures, unprefixed
        assert 0 <= rec["eval/math500/exact_accuracy"] <= 1
    for line in ("aime before training: accuracy", "math500 before training: accuracy", "aime after step 1: accuracy",
                 "math500 after step 1: accuracy"):
        assert line in p.stdout, p.stdout[-2000:]
