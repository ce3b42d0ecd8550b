"""A run directory is one run (issue 48): ``RUN_DIR/config.yaml`` holds the resolved config
and runs it again, ``--save-debug-rollout-data`` keeps each step's samples, a second run
into a used directory is refused without ``--resume``, and ``--resume`` names the training
keys that changed; ``--config`` files layer, and ``--print-config`` prints what
``config.yaml`` will hold."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import yaml

from launcher.config import build_config, load_config
from launcher.config.loading import config_yaml
from tests.e2e.test_grpo_modes import ROOT, records, run_train, train_cmd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600, func_only=True)]
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")


def _relay(args: list[str], data: dict) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, RELAY_CACHE=data["cache"]))


def test_a_run_directory_holds_its_config_refuses_a_second_run_and_resumes_from_its_config(data, tmp_path):
    run_dir = str(tmp_path / "run")
    run_train("tiny-cpu-split", data, run_dir, "--num-rollout", "1", "--save-interval", "1",
              "--save-debug-rollout-data")
    # --save-debug-rollout-data: the step's samples, each with its reward, the judge's verdict and advantage
    with open(os.path.join(run_dir, "samples", "step_000001.jsonl")) as f:
        dumped = [json.loads(line) for line in f]
    assert len(dumped) == records(run_dir)[0]["samples"]
    assert all(d["response"] is not None and d["reward"] in (0.0, 1.0) and d["advantage"] is not None
               and d["reward_info"] for d in dumped), dumped[:2]
    saved_path = os.path.join(run_dir, "config.yaml")
    saved = load_config(saved_path)
    assert saved.lr == 1e-3 and saved.hf_checkpoint == data["policy"] and saved.num_rollout == 1
    assert saved.run_dir == run_dir and saved.prompt_data == data["train"]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    with open(metrics) as f:
        first = f.read()
    # a second run there without --resume: refused, nothing written
    p = _relay(train_cmd("tiny-cpu-split", data, run_dir, "--num-rollout", "1"), data)
    assert p.returncode != 0 and "already holds a run (its metrics.jsonl): pass --resume" in p.stderr, p.stderr[-2000:]
    with open(metrics) as f:
        assert f.read() == first
    # --resume with a key that changes the training: refused, naming it
    p = _relay([RELAY, "train", "--config", saved_path, "--resume", "--num-rollout", "2", "--lr", "2e-3"], data)
    assert p.returncode != 0 and "lr (0.001 -> 0.002)" in p.stderr and "--allow-config-changes" in p.stderr, p.stderr
    # the saved config runs the job again: resumed, one more step
    p = _relay([RELAY, "train", "--config", saved_path, "--resume", "--num-rollout", "2"], data)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert [r["step"] for r in records(run_dir)] == [1, 2]


def test_print_config_gives_what_loads_back_and_configs_layer(tmp_path):
    over = tmp_path / "over.yaml"
    over.write_text("lr: 0.25\nrollout_batch_size: 16\n")
    p = subprocess.run([RELAY, "train", "--config", "tiny-cpu-split", "--config", str(over), "--seed", "7",
                        "--print-config"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    printed = build_config(yaml.safe_load(p.stdout))
    assert printed == load_config(["tiny-cpu-split", str(over)], ["--seed", "7"])
    assert (printed.lr, printed.rollout_batch_size, printed.seed) == (0.25, 16, 7)
    assert printed.genrm_model_path == load_config("tiny-cpu-split").genrm_model_path  # the first file's keys stay
    for path in glob.glob(os.path.join(ROOT, "torchrun_configs", "*.yaml")):  # every shipped config round-trips
        cfg = load_config(path)
        assert build_config(yaml.safe_load(config_yaml(cfg))) == cfg, path
