"""The one-pass sampling kernels (engines/builtin/sample_kernels.py ``sample_pairs``) at a decode
batch's shape: greedy rows (the decode graph's picker) and seeded rows at T = 1 (a GRPO
rollout), GPU time per call, this tree's kernel at its settings and at each of a sweep of
(chunk, block, warps), beside a baseline tree's kernel (``--baseline DIR``: a checkout, e.g.
``git archive REV | tar -x -C DIR``) timed alternately in the same run, each call's kernels
replayed from a CUDA graph. Each setting's tokens are checked equal to this tree's default's.
Prints one JSON line.

    python3 benchmarks/pick_bench.py --rows 256 --vocab 151936 --baseline .old --sweep
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._bandwidth import graph_time  # noqa: E402
from engines.builtin import sample_kernels  # noqa: E402


def load_baseline(root: str):
    """``engines.builtin.sample_kernels`` of another checkout, as a package of its own name."""
    init = os.path.join(root, "engines", "__init__.py")
    spec = importlib.util.spec_from_file_location("baseline_engines", init,
                                                  submodule_search_locations=[os.path.dirname(init)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["baseline_engines"] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module("baseline_engines.sample_kernels")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--baseline", help="a checkout whose kernel is timed beside this tree's")
    ap.add_argument("--sweep", action="store_true", help="also time chunk x block x warps settings")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    logits = (torch.randn(a.rows, a.vocab, device="cuda") * 4).bfloat16()
    temps = torch.ones(a.rows, device="cuda")
    seeds = torch.arange(a.rows, dtype=torch.int64, device="cuda") * 7919 + 1
    pos = torch.full((a.rows,), 200, dtype=torch.int64, device="cuda")
    sides = {"tree": sample_kernels}
    if a.baseline:
        sides["baseline"] = load_baseline(a.baseline)
    default = (sample_kernels.PICK_CHUNK, getattr(sample_kernels, "PICK_BLOCK", None), sample_kernels.PICK_WARPS)
    settings = [default]
    if a.sweep:
        settings += [(c, b, w) for c in (4096, 8192, 16384) for b in (1024, 2048) for w in (4, 8)
                     if b <= c and (c, b, w) != default]
    want = {"greedy": sample_kernels.sample_pairs(logits)[:, 0],
            "seeded": sample_kernels.sample_pairs(logits, temps, seeds, pos)[:, 0]}
    times: dict = {}
    for _ in range(a.rounds):
        for name, mod in sides.items():
            for setting in settings if name == "tree" else [None]:
                if setting is not None:
                    mod.PICK_CHUNK, mod.PICK_BLOCK, mod.PICK_WARPS = setting
                label = name if setting in (None, default) else "c{}_b{}_w{}".format(*setting)
                for kind, call in (("greedy", lambda m=mod: m.sample_pairs(logits)),
                                   ("seeded", lambda m=mod: m.sample_pairs(logits, temps, seeds, pos))):
                    if not torch.equal(call()[:, 0], want[kind]):
                        times.setdefault("mismatch", []).append(f"{label}:{kind}")
                    times.setdefault(f"{label}_{kind}_us", []).append(graph_time(call) * 1e6)
        sample_kernels.PICK_CHUNK, sample_kernels.PICK_BLOCK, sample_kernels.PICK_WARPS = default
    read_gb = logits.numel() * logits.element_size() / 1e9
    out = {"bench": "pick", "rows": a.rows, "vocab": a.vocab, "logits_mb": round(read_gb * 1e3, 1),
           "default": "c{}_b{}_w{}".format(*default)}
    for k, v in times.items():
        out[k] = sorted(v)[len(v) // 2] if k != "mismatch" else sorted(set(v))
    for kind in ("greedy", "seeded"):  # read bandwidth of the default setting
        out[f"tree_{kind}_gb_s"] = round(read_gb / (out[f"tree_{kind}_us"] * 1e-6), 1)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
