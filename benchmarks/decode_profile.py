"""Where a built-in engine decode step spends GPU time: profiles eager decode steps (the
same kernels the CUDA graph replays) at a batch size and context length and prints one JSON
line with the step's GPU time and the top kernels by share.

    python benchmarks/decode_profile.py --size 0.6b --batch 256 --context 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engines.builtin import TorchEngine  # noqa: E402
from engines.models.model_builder import make_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    path = make_model(
        "qwen3", a.size, tempfile.mkdtemp(prefix="decode-prof-"), seed=0, dtype="bfloat16", init_device="cuda"
    )
    eng = TorchEngine(path, device="cuda", kv_cache_tokens=a.batch * (a.context + 64), max_running=a.batch)
    prompts = [[5 + (i + j) % 90 for j in range(a.context)] for i in range(a.batch)]

    async def fill():  # fill the cache with each sequence's context (prefill + one decode)
        await asyncio.gather(
            *(eng.generate(p, {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}) for p in prompts)
        )

    asyncio.run(fill())
    # A decode batch by hand: each sequence's context in contiguous blocks.
    bs = eng.block_size
    blocks = -(-(a.context + 1) // bs)
    tables = torch.arange(a.batch * blocks, dtype=torch.int32, device="cuda").view(a.batch, blocks)
    pos = torch.full((a.batch,), a.context, device="cuda")
    slots = tables[:, -1].long() * bs + a.context % bs
    ids = torch.full((a.batch,), 7, device="cuda")
    lens = torch.full((a.batch,), a.context + 1, dtype=torch.int32, device="cuda")

    def step():
        return eng.model.decode(ids, pos, slots, tables, lens, eng.runner.k, eng.runner.v)

    step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    eager_ms = (time.perf_counter() - t) / a.steps * 1e3
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        cuda_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if cuda_us and ev.key and not ev.key.startswith("ProfilerStep"):
            rows.append((ev.key[:80], cuda_us / a.steps, ev.count // a.steps))
    rows = [r for r in rows if not r[0].startswith("aten::")]
    total = sum(r[1] for r in rows)
    rows.sort(key=lambda r: -r[1])
    out = {
        "bench": "decode_profile",
        "model": f"qwen3-{a.size}",
        "batch": a.batch,
        "context": a.context,
        "eager_step_ms": round(eager_ms, 3),
        "kernel_ms_per_step": round(total / 1e3, 3),
        "kernels_per_step": sum(r[2] for r in rows),
        "top": [
            {"kernel": k, "ms": round(us / 1e3, 3), "calls": c, "share": round(us / total, 3)} for k, us, c in rows[:14]
        ],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
