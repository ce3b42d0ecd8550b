"""One GRPO step, phase by phase: runs ``relay train`` (the real stack: controller, agent,
workers, engines, judge service + gateway + client, Megatron trainer) in colocate Split and
Defer-swap on this machine's GPUs (or virtual CPU bundles), with random-weight Qwen3-shaped
policy and judge, and prints one JSON line per mode: mean seconds per phase over the steps
after the first, the share of the step spent on orchestration (not generating, judging,
training, swapping or moving weights), the memory in use per GPU per phase, and how far the
trainer's log-probs are from the engines' (the largest gap, mismatch_kl, the TIS clip
fraction; ``benchmarks/grpo_learning_bench.py`` measures them with trained, peaked models).

    python benchmarks/grpo_step_bench.py --device cuda --size 0.6b --gpus 2 --steps 3
    python benchmarks/grpo_step_bench.py --device cpu --size tiny --gpus 2 --steps 2   # smoke run
    python benchmarks/grpo_step_bench.py --arch qwen3_moe --size 30b-a3b --layers 2 --gpus 1 --modes defer
    python benchmarks/grpo_step_bench.py --size 0.6b --gpus 1 --modes defer --prompts 8 --n 8 --response-len 8192 \
        --steps 1 --train-args=--bf16                          # 64 samples of 8,192-token responses

``--arch`` / ``--layers``: both models of that architecture (qwen3_moe: Qwen3-MoE shapes), at
reduced depth.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from engines.settings import settings as engines_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build(cache: str, size: str, device: str, arch: str = "qwen3", layers: int | None = None) -> tuple[str, str, dict]:
    from engines.models.model_builder import make_model
    from launcher.demo_task import write_demo_data

    dtype = "bfloat16" if device == "cuda" else "float32"
    init = "cuda" if device == "cuda" else "cpu"
    paths = write_demo_data(os.path.join(cache, "data"))
    tag = f"{arch}-{size}" + (f"-{layers}l" if layers else "")
    policy, judge = os.path.join(cache, f"policy-{tag}"), os.path.join(cache, f"judge-{tag}")
    depth = {"num_hidden_layers": layers} if layers else {}
    for path, seed in ((policy, 1), (judge, 7)):
        if not os.path.exists(os.path.join(path, "config.json")):
            make_model(arch, size, path, seed=seed, dtype=dtype, init_device=init, **depth)
    return policy, judge, paths


def judge_context(args) -> dict:
    """The judge's ``max_context_len`` when responses are long: the response and its prompt
    template fit in one request."""
    return {"max_context_len": args.response_len + 2048} if args.response_len > 2048 else {}


def run_mode(mode: str, args, policy: str, judge: str, data: dict, cache: str) -> dict:
    g = args.gpus
    if mode == "split":
        layout = [
            "--config",
            "tiny-cpu-split",
            "--resource",
            json.dumps({"actor": [1, g], "rollout": [1, g // 2], "genrm": [1, g - g // 2]}),
            "--sglang-mem-fraction-static",
            "0.5",
            "--genrm-engine-config",
            json.dumps({"mem_fraction_static": 0.3, **judge_context(args)}),
        ]
    elif mode == "shared":  # co-resident: rollout and judge awake together on every GPU
        layout = [
            "--config",
            "tiny-cpu-shared",
            "--resource",
            json.dumps({"actor": [1, g], "rollout": [1, g], "genrm": [1, g]}),
            "--sglang-mem-fraction-static",
            "0.5",
            "--genrm-engine-config",
            json.dumps({"mem_fraction_static": 0.3, **judge_context(args)}),
        ]
    else:
        layout = [
            "--config",
            "tiny-cpu-defer",
            "--resource",
            json.dumps({"actor": [1, g], "rollout": [1, g], "genrm": [1, g]}),
            "--sglang-mem-fraction-static",
            str(args.mem_fraction),
            "--genrm-engine-config",
            json.dumps({"mem_fraction_static": args.mem_fraction, **judge_context(args)}),
        ]
    run_dir = os.path.join(cache, "runs", f"{mode}-{int(time.time())}")
    cmd = [
        sys.executable,
        "-m",
        "launcher.cli",
        "train",
        *layout,
        "--device",
        args.device,
        "--gpus-per-node",
        str(g),
        "--hf-checkpoint",
        policy,
        "--genrm-model-path",
        judge,
        "--prompt-data",
        data["train"],
        "--run-dir",
        run_dir,
        "--num-rollout",
        str(args.steps),
        "--rollout-batch-size",
        str(args.prompts),
        "--n-samples-per-prompt",
        str(args.n),
        "--global-batch-size",
        str(args.prompts * args.n),
        "--rollout-max-response-len",
        str(args.response_len),
        "--genrm-sampling-config",
        json.dumps({"temperature": 0.0, "max_response_len": 8}),
        "--genrm-parse",
        "loose",
        "--genrm-gateway-port",
        "0",
        "--lr",
        "1e-6",
        "--kv-cache-tokens",
        str(args.kv_cache_tokens or max(65536, args.prompts * args.n * (args.response_len + 256))),
        *args.train_args.split(),
    ]
    t = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, RELAY_CACHE=cache))
    wall = time.monotonic() - t
    if p.returncode != 0:
        return {"mode": mode, "error": (p.stdout[-2000:] + p.stderr[-3000:])}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    steady = recs[1:] or recs
    phases = ("rollout", "reward", "swap", "train", "sync", "orchestration")
    out = {
        "mode": mode,
        "device": args.device,
        "arch": args.arch,
        "size": args.size,
        "layers": args.layers,
        "gpus": g,
        "train_args": args.train_args,
        **({"mem_fraction": args.mem_fraction} if mode == "defer" else {}),
        "steps": len(recs),
        "wall_s": round(wall, 1),
        "started_s": _started_s(p.stdout + p.stderr),
        "samples_per_step": recs[0]["samples"],
        "response_len_mean": round(statistics.fmean(r["rollout/response_len"] for r in steady), 1),
    }
    step = statistics.fmean(r["time/step"] for r in steady)
    out["step_s"] = round(step, 3)
    for ph in phases:
        vals = [r.get(f"time/{ph}", 0.0) for r in steady]
        out[f"{ph}_s"] = round(statistics.fmean(vals), 3)
    out["orchestration_share"] = round(out["orchestration_s"] / step, 4)
    moves = sorted({k for r in steady for k in r if k.startswith("time/swap_")})
    out["swap_moves_s"] = {k.removeprefix("time/swap_"): round(statistics.fmean(r.get(k, 0.0) for r in steady), 3)
                           for k in moves}  # the swap phase, move by move (launcher/rl/swaps.py)
    out["rollout_tokens_per_s"] = round(statistics.fmean(r["rollout/tokens_per_s"] for r in steady), 1)
    for key in ("rollout/graph_capture_s", "judge/graph_capture_s"):  # inside the rollout and judge phases
        out[key.replace("/", "_")] = round(statistics.fmean(r.get(key, 0.0) for r in steady), 3)
    for key in ("mem/gpu_used_generating", "mem/gpu_used_training", "mem/gpu_used_synced"):
        if key in steady[-1]:
            out[key.split("/", 1)[1] + "_gib"] = [round(b / 2**30, 2) for b in steady[-1][key]]
    out["engine_bytes_training"] = steady[-1].get("mem/engine_bytes_training")
    out["trainer_stays_on_device"] = [r.get("mem/trainer_stays_on_device") for r in recs]
    out["judge_requests"] = steady[-1].get("judge/requests")
    # training against the engines: the largest |engine - trainer| log-prob gap of a response
    # token, mismatch_kl and the TIS clip fraction (with --use-tis) over every step
    gaps = [r["train/rollout_logprob_abs_diff_max"] for r in recs if "train/rollout_logprob_abs_diff_max" in r]
    out["logprob_gap_max"] = max(gaps) if gaps else None
    for key in ("mismatch_kl", "tis_clipfrac"):
        values = [r[f"train/{key}"] for r in recs if f"train/{key}" in r]
        out[key] = round(statistics.fmean(values), 6) if values else None
    return out


def _started_s(output: str) -> float | None:
    """The job's own start-up time: its "started ... in X s" line (roles spawned, trainer
    initialized, engines and judge up), None if missing."""
    m = re.search(r"^started .* in ([0-9.]+) s", output, re.M)
    return float(m.group(1)) if m else None


def main() -> None:

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--arch", default="qwen3", help="policy and judge architecture (qwen3, qwen3_moe)")
    ap.add_argument("--layers", type=int, default=None, help="reduced depth: this many decoder layers")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="the engines' KV cache (default: every sample's prompt and response at once, at least 65,536)")
    ap.add_argument("--modes", default="split,defer", help="comma-separated: split, shared (co-resident), defer")
    ap.add_argument("--mem-fraction", type=float, default=0.8,
                    help="Defer-swap: the rollout engines' and the judge's mem_fraction_static (smaller: the trainer "
                         "may stay on the device between steps, when the engines' wakes fit beside it)")
    ap.add_argument("--train-args", default="", help="extra `relay train` flags, e.g. '--bf16'")
    ap.add_argument("--cache", default=engines_settings().cache + "/grpo-bench")
    args = ap.parse_args()
    cache = os.path.abspath(args.cache)
    policy, judge, data = build(cache, args.size, args.device, args.arch, args.layers)
    for mode in args.modes.split(","):
        print(json.dumps(run_mode(mode, args, policy, judge, data, cache)), flush=True)


if __name__ == "__main__":
    main()
