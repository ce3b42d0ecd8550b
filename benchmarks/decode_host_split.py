"""Is decode host-bound or device-bound? Per token step of the built-in engine, the engine
thread's time waiting on the step's readback event (the device still computing) apart from
the rest (host work: scheduling, inputs, launches, appending tokens), at each batch.

Prints one JSON line: per batch, tok/s, wall ms a token step, host ms and waiting ms a step
(per readback), and the scheduled steps (each runs ahead a chain of decode steps, then
drains the pipeline). When waiting is well above zero the host is ahead of the device.
``--profile N``: one more generation per batch with the engine thread under cProfile (its
own overhead slows the host: read the shares, not the sums), the N functions of most own
time, in microseconds a token step (``host_profile_us``).

    python3 benchmarks/decode_host_split.py --size 0.6b --batches 1,64,256 [--profile 20]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engines.builtin import TorchEngine  # noqa: E402
from engines.builtin import sampler as sampler_module  # noqa: E402
from engines.builtin import stepper as stepper_module  # noqa: E402
from engines.models.model_builder import make_model  # noqa: E402


class Clock:
    """Wraps ``Sampled.read`` and ``Stepper.step`` to add up waiting and stepping time."""

    def __init__(self):
        self.wait = self.step = 0.0
        self.reads = self.steps = 0
        read, step = sampler_module.Sampled.read, stepper_module.Stepper.step
        clock = self

        def timed_read(sampled):
            if sampled.event is not None:
                t = time.perf_counter()
                sampled.event.synchronize()
                clock.wait += time.perf_counter() - t
                sampled.event = None
            clock.reads += 1
            return read(sampled)

        def timed_step(stepper):
            t = time.perf_counter()
            done = step(stepper)
            clock.step += time.perf_counter() - t
            clock.steps += 1
            return done

        sampler_module.Sampled.read = timed_read
        stepper_module.Stepper.step = timed_step

    def reset(self) -> None:
        self.wait = self.step = 0.0
        self.reads = self.steps = 0


async def profile(eng: TorchEngine, prompts: list, sp: dict, top: int) -> dict:
    """{function: own µs a token step} of the engine thread over one more generation."""
    import pstats

    prof, steps = cProfile.Profile(), eng.stepper.steps

    def profiled(*args, **kwargs):  # runs in the engine thread: cProfile sees that thread only
        prof.enable()
        try:
            return steps(*args, **kwargs)
        finally:
            prof.disable()

    eng.stepper.steps = profiled
    try:
        await asyncio.gather(*(eng.generate(p, sp) for p in prompts))
    finally:
        eng.stepper.steps = steps
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    per_step = 1e6 / sp["max_new_tokens"]
    return {f"{os.path.basename(f)}:{line}({name})": round(v[2] * per_step, 1) for (f, line, name), v in rows}


async def measure(eng: TorchEngine, clock: Clock, batch: int, prompt: int, new: int, top: int = 0) -> dict:
    prompts = [[5 + (i + j) % 90 for j in range(prompt)] for i in range(batch)]
    sp = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    await asyncio.gather(*(eng.generate(p, {**sp, "max_new_tokens": 2}) for p in prompts))  # captures the graph
    clock.reset()
    t = time.perf_counter()
    res = await asyncio.gather(*(eng.generate(p, sp) for p in prompts))
    wall = time.perf_counter() - t
    reads = max(1, clock.reads)
    return {"tok_s": round(sum(len(r.token_ids) for r in res) / wall, 1),
            "wall_ms_per_step": round(wall / reads * 1e3, 4),
            "host_ms_per_step": round((clock.step - clock.wait) / reads * 1e3, 4),
            "wait_ms_per_step": round(clock.wait / reads * 1e3, 4),
            "readbacks": clock.reads, "scheduled_steps": clock.steps,
            **({"host_profile_us": await profile(eng, prompts, sp, top)} if top else {})}


async def run(args) -> dict:
    path = make_model("qwen3", args.size, tempfile.mkdtemp(), seed=0, dtype="bfloat16", init_device=args.device)
    batches = [int(b) for b in args.batches.split(",")]
    clock = Clock()
    eng = TorchEngine(path, device=args.device, kv_cache_tokens=max(batches) * (args.prompt + args.new + 16),
                      max_running=max(batches))
    try:
        return {f"b{b}": await measure(eng, clock, b, args.prompt, args.new, args.profile) for b in batches}
    finally:
        await eng.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile the engine thread: its N functions of most own time")
    args = ap.parse_args()
    print(json.dumps({"device": args.device, "size": args.size, **asyncio.run(run(args))}))


if __name__ == "__main__":
    main()
