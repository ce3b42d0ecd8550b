"""Training math through ``relay train`` as a user runs it (the console script, the demo's
trained judge and warm policy, the 4-bundle Split layout):

- at rollout temperatures 0.5 and 0.7 the trainer's log-probs are the engines' (TIS weights
  1, ``mismatch_kl`` ~0), the entropy is logged and, with a coefficient, in the loss, and
  evaluation samples at the rollout temperature unless ``--eval-temperature`` says otherwise;
- the same rollout trained by a 4-rank trainer as DP 4 x TP 1 and as DP 2 x TP 2 gives the
  same loss and gradient norm, with per-sample (the default) and per-token aggregation;
- a NaN reward stops the job before any weight changes, naming the sample and the reward."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_grpo_modes import TEMPLATE, engine_seq, events, records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400, func_only=True)]
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")  # the console script a user types


def relay_train(data: dict, run_dir: str, *extra: str, cwd: str | None = None, check: bool = True,
                env: dict | None = None):
    cmd = [RELAY, "train", "--config", "tiny-cpu-split", "--prompt-data", data["train"], "--run-dir", run_dir,
           "--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "8",
           "--global-batch-size", "32", "--rollout-max-response-len", "4", "--genrm-gateway-port", "0",
           "--genrm-prompt-template", TEMPLATE, "--hf-checkpoint", data["policy"], "--genrm-model-path", data["judge"],
           "--genrm-parse", "loose", "--genrm-sampling-config", '{"temperature": 0.0, "max_response_len": 8}',
           "--lr", "1e-3", *extra]
    p = subprocess.run(cmd, cwd=cwd or os.path.dirname(run_dir), capture_output=True, text=True, timeout=380,
                       env=dict(os.environ, RELAY_CACHE=data["cache"], **(env or {})))
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def eval_subset(data: dict, path: str, rows: int = 12) -> str:
    with open(data["eval"]) as f, open(path, "w") as out:
        out.writelines(f.readlines()[:rows])
    return path


@pytest.mark.parametrize("temperature,entropy_coef,eval_temperature", [(0.5, 0.0, None), (0.7, 10.0, 0.0)])
def test_at_a_rollout_temperature_the_trainer_computes_the_engines_log_probs(data, tmp_path, temperature,
                                                                              entropy_coef, eval_temperature):
    run_dir = str(tmp_path / "run")
    extra = ["--rollout-temperature", str(temperature), "--use-tis", "--entropy-coef", str(entropy_coef),
             "--eval-prompt-data", eval_subset(data, str(tmp_path / "eval.jsonl")), "--n-samples-per-eval-prompt", "4",
             "--skip-eval-before-train"]
    if eval_temperature is not None:
        extra += ["--eval-temperature", str(eval_temperature)]
    relay_train(data, run_dir, *extra)
    (rec,) = records(run_dir)
    # the trainer's log-probs of the sampled tokens are the engines' (fp32 CPU): TIS weights 1
    assert rec["train/mismatch_kl"] < 1e-4, rec
    assert abs(rec["train/tis"] - 1) < 1e-5 and rec["train/tis_clipfrac"] == 0.0, rec
    assert rec["train/rollout_logprob_abs_diff_max"] < 1e-5, rec
    assert rec["train/grad_norm"] > 0
    # the entropy (at the rollout temperature) is logged; with a coefficient it is in the loss
    assert rec["train/entropy"] > 0
    expected = rec["train/pg_loss"] - entropy_coef * rec["train/entropy"]
    assert rec["train/loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # evaluation samples at the rollout temperature unless told otherwise
    (ev,) = records(run_dir, "eval")
    if eval_temperature is None:
        assert ev["eval/temperature"] == temperature and ev["eval/distinct_answers"] > 1
    else:
        assert ev["eval/temperature"] == 0.0 and ev["eval/distinct_answers"] == 1.0


@pytest.mark.parametrize("per_token", [False, True])
def test_dp4_and_dp2_x_tp2_train_the_same_rollout_alike(data, tmp_path, per_token):
    """The same seed gives the same rollout; the step's loss and gradient norm do not depend on
    how the 4 trainer ranks split into data and tensor parallel (answers of uneven length)."""
    flags = ["--calculate-per-token-loss"] if per_token else []
    out = {}
    for tp in (1, 2):
        run_dir = str(tmp_path / f"tp{tp}")
        relay_train(data, run_dir, "--tensor-model-parallel-size", str(tp), "--genrm-skip-self-check", "true", *flags)
        (out[tp],) = records(run_dir)
    a, b = out[1], out[2]
    assert a["rollout/response_len"] == b["rollout/response_len"] and a["reward/mean"] == b["reward/mean"]
    lengths = a["rollout/response_len"]
    assert lengths != int(lengths), "the answers should be of uneven length"
    assert a["train/grad_norm"] > 0
    for key in ("train/loss", "train/grad_norm", "train/pg_clipfrac", "train/entropy"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (key, a[key], b[key])


NAN_REWARD = '''
import math

calls = 0


async def reward(args, sample, **kwargs):
    """Scores the first step's 32 samples by the answer's length; one sample of the second
    step gets NaN (a bug a user's reward can have)."""
    global calls
    calls += 1
    if calls == 40:
        return math.nan
    return float(len(sample.response) % 2)
'''


def test_a_nan_reward_stops_relay_train_before_any_weight_changes(data, tmp_path):
    (tmp_path / "nan_reward.py").write_text(NAN_REWARD)
    run_dir = str(tmp_path / "run")
    p = relay_train(data, run_dir, "--num-rollout", "2", "--custom-rm-path", "nan_reward.reward",
                    "--genrm-skip-self-check", "true", cwd=str(tmp_path), check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "--custom-rm-path nan_reward.reward" in out and "the reward nan" in out and "row " in out, out[-3000:]
    # step 1 trained and synced version 1; step 2 stopped before training: no second sync
    assert [r["step"] for r in records(run_dir)] == [1]
    for engine in ("rollout0", "rollout1"):
        synced = [d for ev, d in engine_seq(events(run_dir), engine) if ev == "update_weights"]
        assert synced == [1], synced
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert all(json.loads(line).get("step") != 2 for line in f)
