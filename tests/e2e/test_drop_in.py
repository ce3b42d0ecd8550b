"""Reward code and data written for the original, through ``relay train`` unchanged: a row's
``metadata`` object is ``sample.metadata`` (the documentation's agentic reward reads
``sample.metadata["trajectory_steps"]``), the dataset's ``question`` is the judge's, and the
original's launch-script flags parse with their meaning."""

from __future__ import annotations

import json
import os

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
                "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--recompute-granularity", "selective",
                cwd=str(tmp_path))
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


AGENTIC_JUDGES = {name: {"model_path": None, "num_gpus": 1}
                  for name in ("planner_judge", "tool_call_judge", "final_answer_judge")}


def test_a_custom_agentic_rollout_trains_with_the_documented_agentic_reward(data, tmp_path):
    """slime's custom-generate contract: the example rollout generates a plan and a final
    answer through args.sglang_router_ip:port (SGLang's /generate, over the rollout engines)
    with a calculator's output between them that the policy did not write; the documentation's
    agentic reward judges each step by its module's judge instance."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    judges = {name: {**spec, "model_path": data["judge"]} for name, spec in AGENTIC_JUDGES.items()}
    log, run_dir = tmp_path / "samples.jsonl", str(tmp_path / "run")
    relay_train(data, run_dir,
                "--custom-generate-function-path", "examples.generate_reward_model.agentic_rollout.generate",
                "--custom-rm-path", "tests.e2e.recording_reward.agentic",
                "--genrm-instances", json.dumps(judges), "--resource",
                '{"actor": [1, 4], "rollout": [1, 1], "genrm": [1, 3]}', "--rollout-max-response-len", "24",
                "--use-tis", "--rollout-temperature", "0.8", "--genrm-skip-self-check", "true",
                # the demo judge was taught the answer-matching prompt, not step judging: its verdicts
                # may all be 0, so an entropy term makes the policy's own tokens carry a gradient
                "--entropy-coef", "0.01", cwd=root, env={"RELAY_TEST_RECORD": str(log)})
    samples = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(samples) == 32
    for s in samples:
        assert s["modules"][:2] == ["plan", "tool_call"], s["modules"]
        assert s["tokens"] == s["prompt_tokens"] + s["response_length"] <= s["prompt_tokens"] + 24
        assert len(s["mask"]) == len(s["logprobs"]) == s["response_length"]
        tool = [k for k, m in enumerate(s["mask"]) if m == 0]  # the observation: not trained, log-prob 0
        assert tool and all(s["logprobs"][k] == 0.0 for k in tool)
        assert all(lp < 0 for k, lp in enumerate(s["logprobs"]) if s["mask"][k])  # the engines' own log-probs
        assert "Observation: " in s["response"] and s["steps"][1]["output"] in s["response"]
        assert s["version"] == 0 and s["status"] in ("completed", "truncated")
    assert any(s["modules"] == ["plan", "tool_call", "final_answer"] for s in samples)
    (rec,) = records(run_dir)
    assert rec["samples"] == 32 and rec["train/grad_norm"] > 0
    # the trainer's log-probs of the policy's own tokens equal the ones the rollout returned
    # (the tool's tokens, masked, would differ by their whole log-prob)
    assert rec["train/rollout_logprob_abs_diff_max"] < 1e-3 and abs(rec["train/mismatch_kl"]) < 1e-5


def test_a_custom_rollout_that_returns_a_list_stops_the_job_naming_the_function(data, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = "tests.launcher.test_custom_rollout.returns_a_list"
    p = relay_train(data, str(tmp_path / "run"), "--custom-generate-function-path", path, cwd=root, check=False)
    assert p.returncode != 0
    assert f"--custom-generate-function-path {path} returned a list: one sample per call is trained here" in p.stderr
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl") or not records(str(tmp_path / "run"))
