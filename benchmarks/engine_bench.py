"""Built-in engine vs transformers ``generate`` on the same model and device, in one run.

Prints one JSON line: tok_s_b{1,8,64,256}_builtin and _hf (generated tokens/s at a fixed
output length, ignore_eos), on GPU roofline_frac_b{batch} (bytes a decode step must read
— weights + KV — over the step time, against the device's READ bandwidth measured in the
same run with read-only kernels: benchmarks/_bandwidth.py),
and sleep/wake seconds (sleep_s_backup, wake_s_backup, sleep_s_discard, pinned_copy_s).

    python benchmarks/engine_bench.py                      # CPU: tiny Qwen3, prompt 16, 32 new
    python benchmarks/engine_bench.py --size 0.6b --device cuda --prompt 128 --new 256
    python benchmarks/engine_bench.py --size 0.6b --device cuda --temperature 1 --seeded   # as a GRPO rollout samples
    python benchmarks/engine_bench.py --arch qwen3_moe --size 30b-a3b --batches 64,256 --no-swap [--layers 24]

For a hybrid model (qwen3_5_moe) the KV is the full-attention layers' and each sequence's
linear-attention state (read once a step) is added.
For a mixture-of-experts model the roofline's weight bytes are those a decode step must read:
every non-expert weight, and in each MoE layer the experts the batch's tokens are routed to
(expected distinct experts of b tokens choosing k of E uniformly: E (1 - (1 - k/E)^b); random
weights route about uniformly), plus the KV.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._bandwidth import copy_bandwidth, read_bandwidth  # noqa: E402
from engines.builtin import TorchEngine  # noqa: E402
from engines.models.model_builder import make_model  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


async def builtin_tok_s(eng: TorchEngine, batch: int, prompt: int, new: int, temperature: float = 0.0,
                        seeded: bool = False) -> tuple[float, float]:
    """(tokens/s of ``batch`` requests of ``new`` tokens each, end to end: prefill included;
    seconds a decode step of the whole batch takes: the run's time less that of the same
    requests for ``decode_from(new)`` tokens, over the steps between. Both runs hold the same
    prefills and the steps while the batch is admitted (long prompts are admitted a few a
    step, ``max_prefill_tokens``), so the difference is steps of every row decoding.)"""
    prompts = [[5 + (i + j) % 90 for j in range(prompt)] for i in range(batch)]
    sp = {"temperature": temperature, "max_new_tokens": new, "ignore_eos": True}
    seeds = [{"seed": 64 * i} if seeded else {} for i in range(batch)]  # a GRPO rollout seeds each sample
    first = decode_from(new)
    await asyncio.gather(
        *(eng.generate(p, {**sp, **k, "max_new_tokens": first}) for p, k in zip(prompts, seeds))
    )  # warm-up: captures the graphs of this batch and of those its admission steps decode
    times = []
    for tokens in (first, new):
        t = time.perf_counter()
        res = await asyncio.gather(*(eng.generate(p, {**sp, **k, "max_new_tokens": tokens})
                                     for p, k in zip(prompts, seeds)))
        times.append(time.perf_counter() - t)
    return sum(len(r.token_ids) for r in res) / times[1], (times[1] - times[0]) / max(1, new - first)


def decode_from(new: int) -> int:
    """The shorter run's tokens in :func:`builtin_tok_s`'s decode step: a quarter of ``new``
    (past the admission of a batch of long prompts), at least 1."""
    return max(1, new // 4)


def decode_context(prompt: int, new: int) -> int:
    """The mean context of the decode steps :func:`builtin_tok_s` measures (the roofline's)."""
    return prompt + (decode_from(new) + new) // 2


def hf_tok_s(model, batch: int, prompt: int, new: int, device: str, static_compile: bool = False) -> float:
    """transformers ``generate`` tokens/s; ``static_compile``: static KV cache, which makes
    transformers torch.compile the forward (warmed up at this exact shape first)."""
    ids = torch.tensor([[5 + (i + j) % 90 for j in range(prompt)] for i in range(batch)], device=device)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    if static_compile:
        kw["cache_implementation"] = "static"
        model.generate(ids, **kw)
    else:
        model.generate(ids[: min(batch, 8)], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
    sync(device)
    t = time.perf_counter()
    out = model.generate(ids, **kw)
    sync(device)
    return (out.shape[1] - prompt) * batch / (time.perf_counter() - t)


def matmul_flops(device: str, n: int = 8192) -> float:
    """bf16 matmul FLOP/s, measured now."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * n**3 / (time.perf_counter() - t)


async def swap_times(path: str, device: str, dtype: str) -> dict:
    out = {}
    eng = TorchEngine(path, device=device, dtype=dtype, kv_cache_tokens=4096, weights_mode="backup")
    nbytes = (await eng.stats())["bytes"]["weights"]
    await eng.sleep(["weights"])  # first sleep allocates the pinned buffer
    await eng.wake(["weights"])
    t = time.perf_counter()
    await eng.sleep(["weights"])
    out["sleep_s_backup"] = time.perf_counter() - t
    t = time.perf_counter()
    await eng.wake(["weights"])
    out["wake_s_backup"] = time.perf_counter() - t
    await eng.close()
    eng = TorchEngine(path, device=device, dtype=dtype, kv_cache_tokens=4096, weights_mode="discard")
    t = time.perf_counter()
    await eng.sleep(["weights"])
    out["sleep_s_discard"] = time.perf_counter() - t
    await eng.close()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t = time.perf_counter()
    host.copy_(dev)
    dev.copy_(host)
    sync(device)
    out["pinned_copy_s"] = (time.perf_counter() - t) / 2  # one direction
    out["weight_bytes"] = nbytes
    return out


def decode_weight_bytes(cfg, weight_bytes: int, batch: int) -> tuple[float, float]:
    """(weight bytes a decode step of ``batch`` tokens reads, parameters each token
    multiplies by) of a bf16 model: all of a dense one; for an MoE one the non-expert
    weights plus the expected distinct experts each MoE layer's batch is routed to."""
    if not cfg.num_experts:
        return weight_bytes, weight_bytes / 2
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    dense_bytes = weight_bytes - moe_layers * e * expert_bytes
    touched = e * (1 - (1 - k / e) ** batch)
    return dense_bytes + moe_layers * touched * expert_bytes, dense_bytes / 2 + moe_layers * k * expert_bytes / 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--layers", type=int, default=None,
                    help="reduced depth: this many decoder layers of the size's shape (per-step ratios are per layer)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--new", type=int, default=None)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--skip-hf-above", type=int, default=10**9, help="skip transformers at batch sizes above this")
    ap.add_argument("--swap-only", action="store_true", help="only the sleep/wake figures (e.g. for a 4b judge)")
    ap.add_argument(
        "--hf-compile-batches",
        default="",
        help="also measure transformers with a static cache + torch.compile at these batch sizes (GPU; slow: compiles "
             "per shape)",
    )
    ap.add_argument("--no-swap", action="store_true", help="skip the sleep/wake figures")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the built-in engine's sampling temperature (0: greedy; a GRPO rollout samples at 1)")
    ap.add_argument("--seeded", action="store_true", help="a sampling seed per request (as a GRPO rollout)")
    ap.add_argument("--compare-run-ahead", action="store_true",
                    help="also an engine with run_ahead=False (every step waits for the one before), alternated")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="alternate built-in and transformers this many times per batch size; medians reported (default: 5 on CPU, "
             "1 on GPU)",
    )
    a = ap.parse_args()
    dev = a.device
    prompt = a.prompt or (128 if dev == "cuda" else 16)
    new = a.new or (256 if dev == "cuda" else 32)
    dtype = "bfloat16" if dev == "cuda" else "float32"
    tmp = tempfile.mkdtemp(prefix="engine-bench-")
    depth = {"num_hidden_layers": a.layers} if a.layers else {}
    path = make_model(a.arch, a.size, tmp, seed=0, dtype=dtype, init_device=dev, **depth)
    import transformers

    result = {
        "bench": "engine",
        "device": dev,
        "model": f"{a.arch}-{a.size}" + (f"-{a.layers}layers" if a.layers else ""),
        "dtype": dtype,
        "prompt": prompt,
        "new_tokens": new,
    }
    if dev == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        result["copy_gb_s"] = round(copy_bandwidth(dev) / 1e9, 1)  # read + write counted; not the roofline's
        read = read_bandwidth(dev)
        result["read_gb_s"] = round(read["best"] / 1e9, 1)
        result["read_gb_s_by_kernel"] = {k: round(v / 1e9, 1) for k, v in read.items() if k != "best"}
        result["matmul_tflops"] = round(matmul_flops(dev) / 1e12, 1)
    if a.swap_only:
        result.update(
            {
                k: round(v, 4) if isinstance(v, float) else v
                for k, v in asyncio.run(swap_times(path, dev, dtype)).items()
            }
        )
        print(json.dumps(result))
        return
    batches = [int(b) for b in a.batches.split(",")]
    kv_tokens = max(batches) * (prompt + new) + 1024

    rounds = a.rounds or (1 if dev == "cuda" else 5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(dev).eval()
    hf_runs: dict[int, list] = {b: [] for b in batches}
    plain_runs: dict[int, list] = {b: [] for b in batches}  # run_ahead=False, with --compare-run-ahead

    async def run_builtin():
        # Built-in and transformers alternate, batch size by batch size, so a noisy spell of
        # the machine hits both sides; each figure is the median over rounds.
        eng = TorchEngine(path, device=dev, dtype=dtype, kv_cache_tokens=kv_tokens, max_running=max(batches))
        plain = None
        if a.compare_run_ahead:
            plain = TorchEngine(path, device=dev, dtype=dtype, kv_cache_tokens=kv_tokens, max_running=max(batches),
                                run_ahead=False)
        runs: dict[int, list] = {b: [] for b in batches}
        decode_runs: dict[int, list] = {b: [] for b in batches}
        for _ in range(rounds):
            for b in batches:
                tok_s, decode_s = await builtin_tok_s(eng, b, prompt, new, a.temperature, a.seeded)
                runs[b].append(tok_s)
                decode_runs[b].append(decode_s)
                if plain is not None:
                    plain_runs[b].append((await builtin_tok_s(plain, b, prompt, new, a.temperature, a.seeded))[0])
                if b <= a.skip_hf_above:
                    hf_runs[b].append(hf_tok_s(hf, b, prompt, new, dev))
        out = {b: statistics.median(v) for b, v in runs.items()}
        out.update({f"decode_step_ms_b{b}": statistics.median(v) * 1e3 for b, v in decode_runs.items()})
        if eng.runner.graphs is not None:  # GPU time of one decode step alone (graph replay), per batch
            graphs = eng.runner.graphs
            for b in batches:
                key = next((k for k in ((b, True), (b, False), b) if k in graphs.graphs), None)
                if key is not None:  # (batch, long context) keys; a plain batch key in older trees
                    graph = graphs.graphs[key][0]
                    # at the mean context of the decode steps measured (the roofline's), each row's
                    # table of distinct blocks, not the inputs left in the shared buffers (the last
                    # batch's: a row past its blocks reads the scratch block, from the L2 cache)
                    ctx = decode_context(prompt, new)
                    bs, nb = eng.runner.blocks.block_size, eng.runner.blocks.num_blocks
                    cols = -(-ctx // bs)
                    graphs.tables[:b, :cols] = (torch.arange(b * cols, device=graphs.tables.device) % nb).view(b, cols)
                    graphs.meta[3, :b] = ctx
                    graphs.meta[1, :b] = ctx - 1
                    sync(dev)
                    t = time.perf_counter()
                    for _ in range(20):
                        graph.replay()
                    sync(dev)
                    out[f"graph_ms_b{b}"] = (time.perf_counter() - t) / 20 * 1e3
        weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())  # before close releases them
        await eng.close()
        if plain is not None:
            await plain.close()
        return out, weights, eng.cfg

    builtin, weight_bytes, cfg = asyncio.run(run_builtin())
    result["rounds"] = rounds
    result["temperature"] = a.temperature
    result["seeded"] = a.seeded
    for key in [k for k in builtin if isinstance(k, str)]:
        result[key] = round(builtin.pop(key), 3)
    for b in batches:
        result[f"tok_s_b{b}_builtin"] = round(builtin[b], 1)
        if plain_runs[b]:
            result[f"tok_s_b{b}_no_run_ahead"] = round(statistics.median(plain_runs[b]), 1)
        result[f"tok_s_b{b}_hf"] = round(statistics.median(hf_runs[b]), 1) if hf_runs[b] else None
        if result[f"tok_s_b{b}_hf"]:
            result[f"speedup_b{b}"] = round(result[f"tok_s_b{b}_builtin"] / result[f"tok_s_b{b}_hf"], 2)
    for b in [int(x) for x in a.hf_compile_batches.split(",") if x]:
        try:
            result[f"tok_s_b{b}_hf_static_compile"] = round(hf_tok_s(hf, b, prompt, new, dev, static_compile=True), 1)
        except Exception as e:  # noqa: BLE001 (a baseline that fails to compile is reported, not fatal)
            result[f"hf_static_compile_error_b{b}"] = repr(e)[:300]
            continue
        if b in builtin:
            result[f"speedup_b{b}_vs_static_compile"] = round(builtin[b] / result[f"tok_s_b{b}_hf_static_compile"], 2)
    hf = None  # release the transformers model before the sleep/wake figures
    if dev == "cuda":
        # Roofline of a decode step at the mean context: the bytes it must read (weights +
        # KV) at the READ bandwidth measured above, and its FLOPs at the measured matmul rate.
        kv_per_token = 2 * cfg.kv_layers * cfg.num_kv_heads * cfg.head_dim * 2  # full-attention layers' KV
        state_per_seq = 0
        if cfg.hybrid:  # a linear-attention layer reads each sequence's recurrent state (float32) and conv state
            from engines.builtin.state_pool import StatePool

            state_per_seq = StatePool(cfg, 1, torch.device("cpu"), torch.bfloat16).row_bytes()
            result["state_mb_per_seq"] = round(state_per_seq / 1e6, 2)
        for b in batches:
            if b in builtin:
                step_s = b / builtin[b]
                ctx = prompt + new / 2
                read_bytes, flop_params = decode_weight_bytes(cfg, weight_bytes, b)
                bytes_step = read_bytes + b * ctx * kv_per_token + b * state_per_seq
                flops_step = 2 * flop_params * b + 4 * b * ctx * cfg.num_layers * cfg.num_heads * cfg.head_dim
                if cfg.num_experts:
                    result[f"active_weight_gb_b{b}"] = round(read_bytes / 1e9, 2)
                result[f"step_ms_b{b}"] = round(step_s * 1e3, 2)
                result[f"roofline_frac_b{b}"] = round(bytes_step / step_s / (result["read_gb_s"] * 1e9), 3)
                result[f"flops_frac_b{b}"] = round(flops_step / step_s / (result["matmul_tflops"] * 1e12), 4)
                if f"graph_ms_b{b}" in result:  # time outside the decode graph: host, sampling, prefill share
                    result[f"outside_graph_share_b{b}"] = round(1 - result[f"graph_ms_b{b}"] / (step_s * 1e3), 3)
                # decode alone (prefill left out: the step time by difference, see builtin_tok_s),
                # at the mean context of the steps measured
                decode_s = result[f"decode_step_ms_b{b}"] / 1e3
                bytes_step = read_bytes + b * decode_context(prompt, new) * kv_per_token + b * state_per_seq
                result[f"decode_roofline_frac_b{b}"] = round(bytes_step / decode_s / (result["read_gb_s"] * 1e9), 3)
                if f"graph_ms_b{b}" in result:  # a decode step's time outside its graph: host work not overlapped
                    result[f"decode_host_share_b{b}"] = round(1 - result[f"graph_ms_b{b}"] / (decode_s * 1e3), 3)
                if f"tok_s_b{b}_no_run_ahead" in result:
                    result[f"step_ms_b{b}_no_run_ahead"] = round(b / result[f"tok_s_b{b}_no_run_ahead"] * 1e3, 2)
    if not a.no_swap:
        result.update(
            {
                k: round(v, 4) if isinstance(v, float) else v
                for k, v in asyncio.run(swap_times(path, dev, dtype)).items()
            }
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
