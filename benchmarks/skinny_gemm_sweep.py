"""The few-rows projection kernel (engines/kernels/skinny_gemm.py) against cuBLAS (``F.linear``) on a
decode step's weight shapes, side by side in one run, with the measured read bandwidth.

Each candidate runs once per layer over ``--layers`` distinct weights of the shape (as a
decode step reads them: not from L2), captured in one CUDA graph and replayed; the figure is
the time per projection and the weight bytes read per second. Candidates: cuBLAS, the
kernel's own configuration (``config``) and BLOCK_N 2-16. Also the layer's two folded
prologues (RMSNorm + residual before q/k/v, SiLU-and-multiply before down) against the
separate kernels they replace. Prints one JSON line.

    python3 benchmarks/skinny_gemm_sweep.py --rows 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._bandwidth import graph_time, read_bandwidth  # noqa: E402
from engines.kernels import skinny_gemm  # noqa: E402
from engines.kernels.paged_attention import rms_norm, silu_mul  # noqa: E402

# Qwen3-0.6B: hidden 1024, 16 x 128 query heads, 8 x 128 KV heads, MLP 3072, vocabulary 151,936
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}


def prologues(rows: int, layers: int, h: int = 1024, inter: int = 3072) -> dict:
    """The folded prologues against the kernels they replace, per projection: RMSNorm with
    the residual add before q/k/v, SiLU-and-multiply before down."""
    dev, dt = "cuda", torch.bfloat16
    x, r = (torch.randn(rows, h, device=dev, dtype=dt) for _ in range(2))
    nw = torch.ones(h, device=dev, dtype=dt)
    wq = [torch.randn(4096, h, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
    gu = torch.randn(rows, 2 * inter, device=dev, dtype=dt)
    wd = [torch.randn(h, inter, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
    linear = skinny_gemm.skinny_linear
    times = {
        "norm_qkv_separate": lambda: [F.linear(rms_norm(x, nw, 1e-6, residual=r)[0], w) for w in wq],
        "norm_qkv_folded": lambda: [linear(x, w, norm_weight=nw, residual=r, eps=1e-6) for w in wq],
        "silu_down_separate": lambda: [F.linear(silu_mul(gu[:, :inter], gu[:, inter:]), w) for w in wd],
        "silu_down_folded": lambda: [linear(gu, w, silu_input=True) for w in wd],
    }
    return {name: round(graph_time(f) / layers * 1e6, 2) for name, f in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=28)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = {"device": torch.cuda.get_device_name(0), "read_gb_s": read_bandwidth(dev)["best"] / 1e9, "shapes": {}}
    for name, (n, k) in SHAPES.items():
        copies = 2 if name == "lm_head" else args.layers
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        nbytes = n * k * 2
        per_rows = {}
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, device=dev, dtype=dt)
            cands = {"cublas": lambda w, x=x: F.linear(x, w), "config": lambda w, x=x: skinny_gemm.skinny_linear(x, w)}
            for bn in (2, 4, 8, 16):
                bk = max(16, min(1 << (k - 1).bit_length(), skinny_gemm._TILE // bn))
                for warps in (4, 8):
                    cands[f"n{bn}w{warps}"] = lambda w, x=x, b=(bn, bk, warps): skinny_gemm.skinny_linear(x, w, block=b)
            times = {c: graph_time(lambda f=f, ws=ws: [f(w) for w in ws]) / copies for c, f in cands.items()}
            per_rows[rows] = {"us": {c: round(t * 1e6, 2) for c, t in times.items()},
                              "gb_s": {c: round(nbytes / t / 1e9) for c, t in times.items()},
                              "config": list(skinny_gemm.config(n, k, sms))}
        result["shapes"][name] = per_rows
    result["prologues"] = {rows: prologues(rows, args.layers) for rows in map(int, args.rows.split(","))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
