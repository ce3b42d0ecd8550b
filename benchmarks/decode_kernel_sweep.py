"""The built-in engine's decode attention kernel alone at long contexts, over its launch
choices, against the read roofline measured in the same run: for each batch, the tuned
choice (what the engine runs) and every (splits, tile, warps, stages) of the sweep, each
timed from CUDA-graph replays. Prints one JSON line: per batch the tuned figure, the best
one and its choice (ms, GB/s, share of the read bandwidth), the six fastest choices (us).
The bytes counted are the K and V the context must read (the queries and outputs are
negligible); each replay reads distinct layers' K and V, 1 GiB together, so that the L2
cache does not serve them.

    python benchmarks/decode_kernel_sweep.py --context 8192 --batches 1,16,64
    TRITON_INTERPRET=1 python benchmarks/decode_kernel_sweep.py --device cpu --context 64 --batches 2 --quick
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def timed_choice(choice: tuple, inputs: tuple, ref: torch.Tensor, dev: torch.device) -> tuple:
    """``(choice, seconds or None, why not or None)`` of the kernel at ``choice`` ((splits,
    tile, warps, stages)) on ``inputs`` (q, k, v, tables, lengths, scale); a wrong result or a
    choice that cannot compile here is reported, not timed."""
    from benchmarks._bandwidth import graph_time
    from engines.kernels.paged_attention import _triton_decode

    splits, *config = choice
    q, k, v, tables, lens, scale = inputs
    call = functools.partial(_triton_decode, q, k, v, tables[0], lens, scale, splits=splits, config=tuple(config))
    try:
        if (call().float() - ref.float()).abs().max() > 5e-2:
            return choice, None, "wrong result"
        if dev.type == "cuda":
            # one call over each of the tables (distinct pages: a model's layers) so that the L2
            # cache does not hold the next replay's K and V
            def layers():
                for t in tables:
                    _triton_decode(q, k, v, t, lens, scale, splits=splits, config=tuple(config))

            return choice, graph_time(layers) / len(tables), None
        t0 = time.perf_counter()
        call()
        return choice, time.perf_counter() - t0, None
    except Exception as e:  # noqa: BLE001 - a choice that cannot compile here: reported
        return choice, None, f"{type(e).__name__}: {str(e)[:120]}"


def figure(choice: tuple, sec: float, kv_bytes: int, read: float | None) -> dict:
    row = {"choice": dict(zip(("splits", "tile", "warps", "stages"), choice)), "ms": sec * 1e3,
           "gb_s": kv_bytes / sec / 1e9}
    if read:
        row["read_frac"] = kv_bytes / sec / read
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="two choices only (a smoke run)")
    args = ap.parse_args()
    from benchmarks._bandwidth import read_bandwidth
    from engines.kernels.paged_attention import (
        decode_config,
        decode_splits,
        multiprocessors,
        paged_decode_attention_ref,
        split_config,
    )

    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    h, kvh, d, page, ctx = args.heads, args.kv_heads, args.dim, args.page, args.context
    read = read_bandwidth(args.device)["best"] if dev.type == "cuda" else None
    out: dict = {"context": ctx, "heads": h, "kv_heads": kvh, "dim": d, "page": page,
                 "read_gb_s": read / 1e9 if read else None}
    grid = [(1, 64, 4, 3), (2, 64, 4, 3)] if args.quick else [
        (s, t, w, st) for s, t, w, st in itertools.product((1, 2, 4, 8, 16, 32, 64), (64, 128), (4, 8), (2, 3))
    ]
    for b in (int(x) for x in args.batches.split(",")):
        pages = ctx // page
        kv_bytes = 2 * b * ctx * kvh * d * dt.itemsize
        # as many layers as make 1 GiB of K and V (a model's step reads each layer's once; the
        # L2 cache, 50 MB on an H100, must not serve a repeated read)
        n_layers = max(1, -(-(1 << 30) // kv_bytes)) if dev.type == "cuda" else 1
        k = torch.randn(n_layers * b * pages + 1, page, kvh, d, device=dev, dtype=dt)
        v = torch.randn_like(k)
        order = torch.randperm(n_layers * b * pages, device=dev).to(torch.int32)  # scattered pages
        tables = list(order.view(n_layers, b, pages).unbind(0))
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(b, h, d, device=dev, dtype=dt)
        scale = d**-0.5
        ref = paged_decode_attention_ref(q, k, v, tables[0], lens, scale)
        tuned_splits = decode_splits(b, kvh, dev, pages * page) if dev.type == "cuda" else 1
        tuned = (tuned_splits, *(decode_config(b, kvh, dev) if tuned_splits == 1 else split_config(tuned_splits)))
        # splits past 16 programs an SM (or past the context's tiles) are not tried
        most = 16 * multiprocessors(dev) if dev.type == "cuda" else 1 << 30
        sweep = [c for c in grid if c != tuned and b * kvh * c[0] <= max(most, b * kvh) and c[0] * c[1] <= ctx]
        inputs = (q, k, v, tables, lens, scale)
        timed_choice(tuned, inputs, ref, dev)  # a warm-up: the GPU's clocks, Triton's compile
        results = [timed_choice(choice, inputs, ref, dev) for choice in [tuned] + sweep]
        timed = [(c, s) for c, s, err in results if s is not None]
        out[f"b{b}"] = {
            "tuned": figure(*timed[0], kv_bytes, read) if timed and timed[0][0] == tuned else {"error": results[0][2]},
            "best": figure(*min(timed, key=lambda x: x[1]), kv_bytes, read) if timed else None,
            "top": [[*c, round(sec * 1e6, 2)] for c, sec in sorted(timed, key=lambda x: x[1])[:6]],  # choice, us
            "failed": [{"choice": c, "why": err} for c, _, err in results if err][:5],
            "tried": len(results),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
