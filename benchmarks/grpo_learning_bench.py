"""Does GRPO learn, and how close are the trainer's log-probs to the engines'? The demo's task
(``relay demo``: "What is N mod 10?", a judge taught with ``relay sft``) with trained, peaked
models, run as a user runs it: ``relay sft`` for the judge and the policy's warm-up, then
``relay train --config demo-grpo`` on one device in a shared layout (Co-resident: rollout and
judge engines on the GPU, the trainer takes it while they sleep), at each rollout temperature.
One JSON line per temperature: held-out exact accuracy before and after (greedy evaluation)
and its rise; the largest |engine - trainer| log-prob gap of a response token over the run;
``mismatch_kl``, the TIS weight and its clip fraction (means over the steps); seconds a step.

    python benchmarks/grpo_learning_bench.py --device cuda --temperatures 1.0,0.7 --train-args="--bf16 --use-tis"
    python benchmarks/grpo_learning_bench.py --device cpu --steps 3 --sft-steps 60   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def relay(argv: list[str], cache: str, log: str) -> None:
    """One ``relay`` job as a process (``RELAY_CACHE=cache``); a failure raises with its tail."""
    with open(log, "w") as out:
        p = subprocess.run([sys.executable, "-m", "launcher.cli", *argv], cwd=ROOT, stdout=out,
                           stderr=subprocess.STDOUT, env=dict(os.environ, RELAY_CACHE=cache, PYTHONUNBUFFERED="1"))
    if p.returncode:
        with open(log) as f:
            raise RuntimeError(f"relay {' '.join(argv[:3])} failed (exit {p.returncode}):\n{f.read()[-3000:]}")


def device_flags(device: str) -> list[str]:
    return ["--device", device, "--gpus-per-node", "1"]


def build_models(cache: str, device: str, judge_steps: int | None, logs: str) -> None:
    """The demo's data, base models, judge (SFT) and warm policy (SFT) under ``cache/demo``."""
    from engines.models.model_builder import make_model
    from launcher.demo_task import write_demo_data

    root = os.path.join(cache, "demo")
    write_demo_data(os.path.join(root, "data"))
    for name, seed in (("policy-base", 1), ("judge-base", 7)):
        make_model("qwen3", "tiny", os.path.join(root, name), seed=seed)
    steps = ["--sft-steps", str(judge_steps)] if judge_steps else []
    relay(["sft", "--config", "demo-judge-sft", *device_flags(device), *steps], cache, os.path.join(logs, "judge.log"))
    relay(["sft", "--config", "demo-policy-sft", *device_flags(device)], cache, os.path.join(logs, "policy.log"))


def grpo(cache: str, device: str, temperature: float, steps: int | None, train_args: list[str], logs: str) -> dict:
    run_dir = os.path.join(cache, "demo", "runs", f"grpo-t{temperature}")
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = ["train", "--config", "demo-grpo", *device_flags(device),
            "--resource", json.dumps({"actor": [1, 1], "rollout": [1, 1], "genrm": [1, 1]}),
            "--sglang-mem-fraction-static", "0.4", "--rollout-temperature", str(temperature), "--run-dir", run_dir,
            *(["--num-rollout", str(steps)] if steps else []), *train_args]
    t0 = time.monotonic()
    relay(argv, cache, os.path.join(logs, f"grpo-t{temperature}.log"))
    wall = time.monotonic() - t0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    evals = [r for r in records if r.get("kind") == "eval"]
    train = [r for r in records if r.get("kind") == "train"]

    def mean(key: str):
        values = [r[key] for r in train if key in r]
        return round(statistics.fmean(values), 6) if values else None

    before, after = evals[0]["eval/exact_accuracy"], evals[-1]["eval/exact_accuracy"]
    gaps = [r["train/rollout_logprob_abs_diff_max"] for r in train if "train/rollout_logprob_abs_diff_max" in r]
    return {"device": device, "rollout_temperature": temperature, "train_args": " ".join(train_args),
            "steps": len(train), "eval_exact_before": before, "eval_exact_after": after,
            "eval_rise_points": round(100 * (after - before), 1), "eval_judged_after": evals[-1]["eval/accuracy"],
            "logprob_gap_max": max(gaps) if gaps else None, "logprob_gap_mean": mean("train/rollout_logprob_abs_diff"),
            "mismatch_kl_mean": mean("train/mismatch_kl"), "tis_mean": mean("train/tis"),
            "tis_clipfrac_mean": mean("train/tis_clipfrac"), "entropy_mean": mean("train/entropy"),
            "step_s": mean("time/step"), "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the demo's 60)")
    ap.add_argument("--sft-steps", type=int, default=None, help="judge SFT steps (default: the demo's 600)")
    ap.add_argument("--train-args", default="--bf16 --use-tis", help="extra `relay train` flags")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="grpo-learning-")
    logs = os.path.join(cache, "logs")
    os.makedirs(logs)
    try:
        build_models(cache, args.device, args.sft_steps, logs)
        for t in args.temperatures.split(","):
            try:
                out = grpo(cache, args.device, float(t), args.steps, args.train_args.split(), logs)
            except RuntimeError as e:
                out = {"rollout_temperature": float(t), "error": str(e)[-2000:]}
            print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
