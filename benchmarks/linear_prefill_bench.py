"""The Gated DeltaNet prefill rule: the torch chunked reference (``chunked_delta_rule``) vs
the Triton kernels (``chunked_prefill``, float32 and TF32 products), one after the other in
one run, at Qwen3.5-35B-A3B's layer shape (32 value heads, head dims 128) on float32 inputs.
Prints one JSON line: ms per call of each, the speed-ups, the largest output/state
difference from the torch rule.

    python benchmarks/linear_prefill_bench.py --shapes 1x1024,8x512,32x256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engines.models.linear_attention import chunked_delta_rule  # noqa: E402
from engines.kernels.linear_kernels import chunked_prefill  # noqa: E402


def _ms(fn, iters: int, device: str) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def _row(shape: str, h: int, d: int, iters: int, dev: str) -> dict:
    s, length = map(int, shape.split("x"))
    q = torch.nn.functional.normalize(torch.randn(s, length, h, d, device=dev), dim=-1) * d**-0.5
    k = torch.nn.functional.normalize(torch.randn(s, length, h, d, device=dev), dim=-1)
    v = torch.randn(s, length, h, d, device=dev)
    beta = torch.rand(s, length, h, device=dev)
    g = -torch.rand(s, length, h, device=dev)
    (o1, s1), (o2, s2) = chunked_delta_rule(q, k, v, beta, g), chunked_prefill(q, k, v, beta, g)
    gap = max((o1 - o2).abs().max().item(), (s1 - s2).abs().max().item())
    o3, s3 = chunked_prefill(q, k, v, beta, g, tf32=True)
    gap_tf32 = max((o1 - o3).abs().max().item(), (s1 - s3).abs().max().item())
    torch_ms = _ms(lambda: chunked_delta_rule(q, k, v, beta, g), iters, dev)
    triton_ms = _ms(lambda: chunked_prefill(q, k, v, beta, g), iters, dev)
    tf32_ms = _ms(lambda: chunked_prefill(q, k, v, beta, g, tf32=True), iters, dev)
    return {"shape": shape, "torch_ms": round(torch_ms, 3), "triton_fp32_ms": round(triton_ms, 3),
            "triton_tf32_ms": round(tf32_ms, 3), "speedup_fp32": round(torch_ms / triton_ms, 2),
            "speedup_tf32": round(torch_ms / tf32_ms, 2), "max_abs_diff_fp32": gap, "max_abs_diff_tf32": gap_tf32}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x1024,8x512,32x256", help="sequences x tokens, comma-separated")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = [_row(shape, a.heads, a.dim, a.iters, a.device) for shape in a.shapes.split(",")]
    print(json.dumps({"bench": "linear_prefill", "device": a.device, "heads": a.heads, "dim": a.dim, "rows": rows}))


if __name__ == "__main__":
    main()
