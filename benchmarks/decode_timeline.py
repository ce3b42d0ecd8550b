"""Where the GPU waits during the built-in engine's decode: a generation at one batch size runs
under the CUDA profiler (kernels, copies and the host's CUDA calls, no Python-op events unless
``--cpu-ops``), and the device's timeline over the decode steps is read back: the decode graphs'
own time, the GPU work outside them (input copies, sampling, readback) by name, and the idle gaps
between them, each split into the part the host was late for (the call that queued the next work
came after the device had finished what was queued) and the part it was not (launch latency).

Prints one JSON line; all times are per decode step (per decode-graph replay) in milliseconds.

    python3 benchmarks/decode_timeline.py --size 0.6b --batch 256 --new 128
    python3 benchmarks/decode_timeline.py --size 0.6b --batch 256 --temperature 1 --seeded
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engines.builtin import TorchEngine  # noqa: E402
from engines.models.model_builder import make_model  # noqa: E402

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def units(trace: dict) -> tuple[list[dict], list[dict]]:
    """The device's work as units (one CUDA graph launch, or one kernel / copy), each with its
    span, the host call that queued it and that call's start; and the host's CUDA calls."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    calls = {e["args"]["correlation"]: e for e in events
             if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    grouped: dict = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_CATS:
            grouped[e.get("args", {}).get("correlation", id(e))].append(e)
    out = []
    for corr, items in grouped.items():
        call = calls.get(corr)
        start = min(i["ts"] for i in items)
        end = max(i["ts"] + i["dur"] for i in items)
        graph = call is not None and call["name"].startswith("cudaGraphLaunch")
        label = f"graph[{len(items)} kernels]" if graph else items[0]["name"][:60]
        out.append({"start": start, "end": end, "label": label, "graph": graph, "kernels": len(items),
                    "queued": None if call is None else call["ts"],
                    "parts": [(i["name"], i["dur"]) for i in items] if graph else []})
    out.sort(key=lambda u: u["start"])
    return out, sorted(calls.values(), key=lambda e: e["ts"])


def kernel_family(name: str) -> str:
    """A kernel's name without its template arguments and launch shapes (a short key that groups
    one op's kernels)."""
    return re.split(r"[<(]", name, maxsplit=1)[0].strip()[:60]


def summarize(trace: dict) -> dict:
    work, calls = units(trace)
    graphs = [u for u in work if u["graph"]]
    if not graphs:
        return {"error": "no CUDA graph launch in the trace (is the engine on CUDA with graphs?)"}
    decode_kernels = collections.Counter(u["kernels"] for u in graphs).most_common(1)[0][0]
    decode = [u for u in graphs if u["kernels"] == decode_kernels]
    lo, hi = decode[0]["start"], decode[-1]["end"]
    window = [u for u in work if lo <= u["start"] and u["end"] <= hi]
    steps = len(decode)
    inside: dict = collections.Counter()  # the decode graph's own kernels by name (their busy time)
    for u in decode:
        for name, dur in u["parts"]:
            inside[kernel_family(name)] += dur
    other: dict = collections.Counter()
    for u in window:
        if not (u["graph"] and u["kernels"] == decode_kernels):
            other[u["label"]] += u["end"] - u["start"]
    idle = late = 0.0
    gaps = []
    busy_until = window[0]["end"]
    prev = window[0]
    for u in window[1:]:
        gap = u["start"] - busy_until
        if gap > 1.0:
            host_late = 0.0 if u["queued"] is None else min(gap, max(0.0, u["queued"] - busy_until))
            idle += gap
            late += host_late
            gaps.append((gap, host_late, prev["label"], u["label"]))
        if u["end"] > busy_until:
            busy_until, prev = u["end"], u
    host_calls: dict = collections.defaultdict(list)  # the host's CUDA calls (its waits too): how long each takes
    for c in calls:
        if lo <= c["ts"] <= hi:
            host_calls[c["name"]].append(c["dur"])
    per = 1e3 * steps  # us -> ms per step
    big = sorted(gaps, reverse=True)[:6]
    by_pair: dict = collections.Counter()
    for g, _, before, after in gaps:
        by_pair[f"{before} -> {after}"] += g
    return {
        "steps": steps,
        "wall_ms": round((hi - lo) / per, 4),
        "graph_ms": round(sum(u["end"] - u["start"] for u in decode) / per, 4),
        "graph_kernels": decode_kernels,
        "graph_busy_ms": round(sum(inside.values()) / per, 4),
        "graph_top": {k: round(v / per, 4) for k, v in inside.most_common(10)},
        "other_gpu_ms": round(sum(other.values()) / per, 4),
        "other_gpu_top": {k: round(v / per, 4) for k, v in other.most_common(8)},
        "idle_ms": round(idle / per, 4),
        "idle_host_late_ms": round(late / per, 4),
        "gaps_over_1us_per_step": round(len(gaps) / steps, 2),
        "idle_by_neighbours_ms": {k: round(v / per, 4) for k, v in by_pair.most_common(6)},
        "largest_gaps_us": [[round(g, 1), round(h, 1), a, b] for g, h, a, b in big],
        "host_calls": {  # name: [calls a step, ms a step, longest us]
            k: [round(len(v) / steps, 2), round(sum(v) / per, 4), round(max(v), 1)]
            for k, v in sorted(host_calls.items(), key=lambda kv: -sum(kv[1]))[:8]
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seeded", action="store_true", help="one seed per request, as a GRPO rollout")
    ap.add_argument("--cpu-ops", action="store_true", help="record Python-side torch ops too (slows the host)")
    ap.add_argument("--trace", help="also write the chrome trace here")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="decode-timeline-")
    try:
        path = make_model("qwen3", a.size, tmp, seed=0, dtype="bfloat16", init_device="cuda")
        eng = TorchEngine(path, device="cuda", kv_cache_tokens=a.batch * (a.prompt + a.new) + 1024,
                          max_running=a.batch)
        prompts = [[5 + (i + j) % 90 for j in range(a.prompt)] for i in range(a.batch)]
        sp = {"temperature": a.temperature, "ignore_eos": True}

        async def generate(new: int):
            await asyncio.gather(*(eng.generate(p, {**sp, "max_new_tokens": new, **({"seed": 64 * i} if a.seeded
                                                                                      else {})})
                                   for i, p in enumerate(prompts)))

        activities = [torch.profiler.ProfilerActivity.CUDA]
        if a.cpu_ops:
            activities.append(torch.profiler.ProfilerActivity.CPU)

        async def run():
            await generate(4)  # captures the batch's graph
            with torch.profiler.profile(activities=activities) as prof:
                await generate(a.new)
            stats = await eng.stats()
            await eng.close()
            return prof, stats

        prof, stats = asyncio.run(run())
        out = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(out)
        if a.trace:
            shutil.copy(out, a.trace)
        with open(out) as f:
            trace = json.load(f)
        print(json.dumps({"batch": a.batch, "prompt": a.prompt, "new": a.new, "temperature": a.temperature,
                          "seeded": a.seeded, "step_failures": stats.get("step_failures"), **summarize(trace)}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
