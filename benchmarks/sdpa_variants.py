"""The trainer's attention choices on this GPU, side by side in one run: causal SDPA forward +
backward with the KV heads expanded (``repeat_interleave``) against ``enable_gqa``, each of
SDPA's fused backends alone (flash, cuDNN, memory-efficient: ms and TFLOP/s), and a
packed micro-batch as one ``varlen_attn`` call against one SDPA call per row. Prints one JSON
line: milliseconds per forward + backward and peak memory of each, and which API this torch has.

    python benchmarks/sdpa_variants.py --seq 8192 --heads 16 --groups 8
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch
import torch.nn.functional as F


def timed(fn, reps: int = 5) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3, torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rows", type=int, default=16, help="rows of the packed micro-batch (lengths spread up to --seq)")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    h, g, d, s = args.heads, args.groups, args.dim, args.seq
    q = torch.randn(1, h, s, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, g, s, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, g, s, d, device=dev, dtype=dt, requires_grad=True)
    out: dict = {"torch": torch.__version__, "seq": s}

    def expanded():
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1),
                                           is_causal=True)
        o.sum().backward()

    def gqa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    out["expanded_ms"], out["expanded_peak_gb"] = timed(expanded)
    # each fused backend alone (GQA as the trainer calls it), with its achieved TFLOP/s
    # (causal forward 2 S^2 d a head, backward 2.5x that)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flops = 3.5 * 2 * s * s * d * h
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                ms, _ = timed(gqa)
            out[f"{name.lower()}_ms"] = ms
            out[f"{name.lower()}_tflops"] = flops / (ms / 1e3) / 1e12
        except Exception as e:  # noqa: BLE001 - reported
            out[f"{name.lower()}_error"] = f"{type(e).__name__}: {e}"[:200]
    try:
        out["enable_gqa_ms"], out["enable_gqa_peak_gb"] = timed(gqa)
    except Exception as e:  # noqa: BLE001 - reported
        out["enable_gqa_error"] = f"{type(e).__name__}: {e}"[:300]
    lengths = [max(16, s * (i + 1) // args.rows // 2) for i in range(args.rows)]
    total = sum(lengths)
    bounds = torch.tensor([0] + lengths, device=dev).cumsum(0).to(torch.int32)
    qt = torch.randn(total, h, d, device=dev, dtype=dt, requires_grad=True)
    kt = torch.randn(total, g, d, device=dev, dtype=dt, requires_grad=True)
    vt = torch.randn(total, g, d, device=dev, dtype=dt, requires_grad=True)

    def per_row():
        parts = []
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            parts.append(F.scaled_dot_product_attention(
                qt[a:b].transpose(0, 1)[None], kt[a:b].transpose(0, 1)[None].repeat_interleave(h // g, 1),
                vt[a:b].transpose(0, 1)[None].repeat_interleave(h // g, 1), is_causal=True)[0].transpose(0, 1))
        torch.cat(parts).sum().backward()

    out["packed_tokens"] = total
    out["per_row_ms"], out["per_row_peak_gb"] = timed(per_row)
    try:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        out["varlen_params"] = [p for p in params if p in ("is_causal", "window_size", "enable_gqa")]
        kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        gq = "enable_gqa" in params

        def varlen():
            kk = kt if gq else kt.repeat_interleave(h // g, 1)
            vv = vt if gq else vt.repeat_interleave(h // g, 1)
            extra = {"enable_gqa": True} if gq else {}
            varlen_attn(qt, kk, vv, bounds, bounds, max(lengths), max(lengths), **kw, **extra).sum().backward()

        out["varlen_ms"], out["varlen_peak_gb"] = timed(varlen)
    except Exception as e:  # noqa: BLE001 - reported
        out["varlen_error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
