"""Where the Megatron trainer's GRPO step spends device time: one ``TrainerActor`` in this
process (one rank), a warm-up step, then one ``train_step`` under torch's profiler; prints one
JSON line with the step's wall time, the device's busy time and the top kernels (by total
device time, grouped by name, with their share of the busy time). ``--anchor`` profiles
transformers (SDPA, AdamW) doing the same rows one at a time, as trainer_bench.py's anchor.

    python benchmarks/trainer_profile.py --device cuda --size 0.6b --bf16 --batch 1 --seq 8192
    python benchmarks/trainer_profile.py --size tiny --batch 2 --seq 256          # CPU: op times
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def top_kernels(prof, device: str, top: int) -> tuple[float, list]:
    """(busy ms, [(name, ms, share)]) of the profiled region's device kernels (CPU: ops' self time)."""
    totals: collections.Counter = collections.Counter()
    for e in prof.events():
        if device == "cuda":
            if e.device_type == torch.autograd.DeviceType.CUDA:
                totals[e.name[:90]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        elif e.device_type == torch.autograd.DeviceType.CPU:
            totals[e.name[:90]] += e.self_cpu_time_total
    busy = sum(totals.values()) / 1e3
    rows = [(n, round(us / 1e3, 3), round(us / 1e3 / busy, 4) if busy else 0.0) for n, us in totals.most_common(top)]
    return busy, rows


def profile(fn, device: str, top: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()  # warm-up
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    busy, rows = top_kernels(prof, device, top)
    return {"wall_ms": round(wall * 1e3, 2), "busy_ms": round(busy, 2), "top": rows}


def ours(args, path: str, seqs: list, masks: list, adv: list) -> dict:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    from engines.trainer.actor import TrainerActor
    from engines.trainer.train_batch import TrainBatch

    t = TrainerActor(path, lr=1e-6, bf16=args.bf16, pack=args.packed,
                     micro_batch_tokens=args.micro_batch_tokens or sum(len(s) for s in seqs))
    t.setup()
    step = getattr(TrainerActor.train_step, "__wrapped__", TrainerActor.train_step)

    def run() -> None:
        step(t, TrainBatch(seqs, masks, adv))
        if args.device == "cuda":
            torch.cuda.synchronize()

    run()  # allocates the optimizer state
    return profile(run, args.device, args.top)


def anchor(args, path: str, seqs: list) -> dict:
    from benchmarks.trainer_bench import anchor_step

    return profile(anchor_step(args, path, [len(q) for q in seqs]), args.device, args.top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=("tiny", "small", "0.6b", "4b"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lengths", help="a,b: the rows' lengths spread evenly over [a, b]")
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--micro-batch-tokens", type=int)
    ap.add_argument("--anchor", action="store_true", help="profile transformers instead of ours")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "relay-trainer-bench"))
    args = ap.parse_args()
    from engines.models.model_builder import make_model

    if args.lengths:
        low, high = (int(x) for x in args.lengths.split(","))
        lengths = [low + (high - low) * i // max(1, args.batch - 1) for i in range(args.batch)]
    else:
        lengths = [args.seq] * args.batch
    dtype = "bfloat16" if args.bf16 else "float32"
    positions = max(4096, max(lengths))
    path = os.path.join(args.cache, f"qwen3-{args.size}-{dtype}-pos{positions}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_model("qwen3", args.size, path, seed=0, dtype=dtype, init_device=args.device,
                   max_position_embeddings=positions)
    seqs = [[5 + (i * 7 + j * 3) % 90 for j in range(n)] for i, n in enumerate(lengths)]
    masks = [[0] * (n // 4 - 1) + [1] * (n - n // 4) for n in lengths]
    adv = [1.0 if i % 2 else -1.0 for i in range(len(lengths))]
    out = {"side": "anchor" if args.anchor else "ours", "size": args.size, "tokens": sum(lengths),
           "rows": len(lengths), "packed": args.packed}
    out.update(anchor(args, path, seqs) if args.anchor else ours(args, path, seqs, masks, adv))
    out["tokens_per_s"] = round(sum(lengths) / (out["wall_ms"] / 1e3), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
