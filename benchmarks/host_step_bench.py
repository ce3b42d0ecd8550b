"""The engine's host work a decode step, alone: this tree against a baseline revision, in one run.

A CPU proxy for what the engine thread does around each step (scheduling, the step's input
tensors, sampling's bookkeeping, reading the tokens back, appending them, ending requests):
the built-in engine on CPU with run-ahead on, its model's decode forward replaced by a fixed
logits tensor (the only stand-in: nothing else of the engine is changed), so a step's time is
host work. Each side runs in its own process (this tree, and ``--baseline`` extracted by
``git archive``), alternated ``--rounds`` times; medians reported. It leaves out what only a
GPU has (pinned copies, events, graph launches): benchmarks/decode_host_split.py measures
those on the device.

Prints one JSON line: per batch, host microseconds a decode step for this tree and the baseline.

    python benchmarks/host_step_bench.py --baseline HEAD~1 --batches 64,256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def _measure(batches: list[int], new: int) -> dict:
    import torch

    from engines.builtin import TorchEngine
    from engines.models.model_builder import make_model

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory(prefix="host-step-")
    path = make_model("qwen3", "tiny", tmp.name, seed=0, num_hidden_layers=1)
    eng = TorchEngine(path, device="cpu", kv_cache_tokens=max(batches) * (new + 64) + 1024,
                      max_running=max(batches), run_ahead=True)
    vocab = eng.cfg.vocab_size
    fixed = torch.zeros(max(batches), vocab)
    fixed[:, 7] = 1.0  # every row's argmax: token 7

    def forward(meta, tables, n, rows=None, ids=None):  # the model's decode step, replaced
        return fixed[:n]

    eng.runner.decode_tensors = forward
    out = {}
    for b in batches:
        prompts = [[5 + (i * 3 + j) % 90 for j in range(32)] for i in range(b)]
        sp = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        await asyncio.gather(*(eng.generate(p, {**sp, "max_new_tokens": 2}) for p in prompts))
        times = []
        for tokens in (1, new):  # prefill and the first token apart (the prefill is the real model's)
            t = time.perf_counter()
            await asyncio.gather(*(eng.generate(p, {**sp, "max_new_tokens": tokens}) for p in prompts))
            times.append(time.perf_counter() - t)
        out[b] = (times[1] - times[0]) / (new - 1) * 1e6
    await eng.close()
    tmp.cleanup()
    return out


def _side(tree: str, batches: str, new: int) -> dict:
    code = (f"import asyncio, json, sys; sys.path.insert(0, {tree!r}); sys.argv = ['x'];"
            "from benchmarks.host_step_bench import _measure;"
            f"print(json.dumps(asyncio.run(_measure({batches!r}, {new}))))")
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="HEAD", help="git revision to compare with (extracted by git archive)")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--new", type=int, default=64, help="tokens a request generates")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    keep = tempfile.TemporaryDirectory(prefix="host-step-baseline-")
    base = keep.name
    archive = subprocess.run(["git", "archive", a.baseline], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
    # the baseline measured by this file's _measure (the same stand-in on both sides)
    with open(os.path.join(base, "benchmarks", "host_step_bench.py"), "w") as f, open(__file__) as src:
        f.write(src.read())
    runs: dict[str, dict[int, list]] = {"tree": {b: [] for b in batches}, "baseline": {b: [] for b in batches}}
    for _ in range(a.rounds):
        for side, tree in (("tree", ROOT), ("baseline", base)):
            for b, us in _side(tree, batches, a.new).items():
                runs[side][b].append(us)
    result = {"bench": "host_step", "baseline": a.baseline, "new_tokens": a.new, "rounds": a.rounds}
    for b in batches:
        tree, baseline = statistics.median(runs["tree"][b]), statistics.median(runs["baseline"][b])
        result[f"host_us_b{b}"] = round(tree, 1)
        result[f"host_us_b{b}_baseline"] = round(baseline, 1)
        result[f"speedup_b{b}"] = round(baseline / tree, 2)
    keep.cleanup()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
