"""The paged decode-attention kernel (engines/kernels/paged_attention.py ``_decode_kernel``) over launch
configurations: tile of context positions, warps, pipeline stages, at a decode batch's shape
(Qwen3-0.6B's heads by default: 16 query heads, 8 KV heads, head dim 128, bf16, 16-token
blocks, scattered). Prints one JSON line: each configuration's time and the K/V read rate it
reaches, the engine's current configuration marked, the best one, and the device's read
bandwidth measured in the same run.

    python benchmarks/decode_attention_sweep.py --batch 256 --contexts 256,1024
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks._bandwidth import _timed, read_bandwidth  # noqa: E402
from engines.kernels import paged_attention as kernels  # noqa: E402


def _case(batch: int, context: int, heads: int, kv_heads: int, dim: int, page: int, head_major: bool) -> dict:
    blocks_per_seq = triton.cdiv(context, page)
    n_blocks = batch * blocks_per_seq + 8
    if head_major:  # each (block, KV head) contiguous: [blocks, KV heads, page, dim] seen as the engine's order
        k = torch.randn(n_blocks, kv_heads, page, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(n_blocks, kv_heads, page, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    else:
        k = torch.randn(n_blocks, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
    tables = torch.randperm(n_blocks, device="cuda")[: batch * blocks_per_seq].view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    return {"q": q, "k": k, "v": v, "tables": tables, "lens": lens,
            "kv_bytes": 2 * batch * context * kv_heads * dim * 2}


def _launch(c: dict, tile: int, warps: int, stages: int):
    q, k, v = c["q"], c["k"], c["v"]
    out = torch.empty_like(q)
    b, h, d = q.shape
    kvh = k.shape[2]
    group = h // kvh

    def run():
        kernels._decode_kernel[(b, kvh, 1)](
            q, k, v, c["tables"], c["lens"], out, out, out, d**-0.5,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), c["tables"].stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), D=d, D_P=max(16, triton.next_power_of_2(d)),
            PAGE=k.shape[1], TILE=tile, IEEE=False, SPLITS=1, num_warps=warps, num_stages=stages,
        )
    return run, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--head-major", action="store_true",
                    help="lay each block out as [KV heads, page, dim] (the engine's cache is [page, KV heads, dim])")
    a = ap.parse_args()
    bw = read_bandwidth("cuda")
    rows = []
    for context in map(int, a.contexts.split(",")):
        c = _case(a.batch, context, a.heads, a.kv_heads, a.dim, a.page, a.head_major)
        ref = kernels.paged_decode_attention(c["q"], c["k"], c["v"], c["tables"], c["lens"], a.dim**-0.5)
        for tile in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4):
                    try:
                        run, out = _launch(c, tile, warps, stages)
                        s = _timed(run, "cuda", 50)
                    except Exception as e:  # noqa: BLE001 (a configuration the compiler refuses)
                        rows.append({"context": context, "tile": tile, "warps": warps, "stages": stages,
                                     "error": str(e)[:120]})
                        continue
                    ok = (out.float() - ref.float()).abs().max().item() < 2e-2
                    rows.append({"context": context, "tile": tile, "warps": warps, "stages": stages,
                                 "us": round(s * 1e6, 1), "read_gb_s": round(c["kv_bytes"] / s / 1e9, 1),
                                 "matches": ok, "current": (tile, warps) == (64, 4) and stages == 3})
    best = {}
    for r in rows:
        if "us" in r and r["matches"] and (r["context"] not in best or r["us"] < best[r["context"]]["us"]):
            best[r["context"]] = r
    print(json.dumps({"bench": "decode_attention_sweep", "batch": a.batch, "head_major": a.head_major,
                      "read_bw_gb_s": bw, "best": best, "rows": rows}))


if __name__ == "__main__":
    main()
