"""The Megatron trainer, measured through relay as the GRPO loop drives it. Prints one JSON
line:

- ``step_s`` / ``tokens_per_s``: one GRPO ``train_step`` (forward + backward, optimizer; the
  batch is one optimizer step, so the old log-probs are its forward's own, detached, as in
  the loop) on ``--batch`` sequences of ``--seq`` tokens, median over ``--steps`` after a
  warm-up step;
- ``offload_s_per_gb`` / ``onload_s_per_gb`` against ``pinned_d2h_s_per_gb`` /
  ``pinned_h2d_s_per_gb``, the pinned host<->device copy measured in the same run (on CPU:
  a host memcpy), and their ratios (the target is <= 1.5);
- ``export_s_per_gb``: ``push_weights`` of the whole model into one built-in engine on the
  same device; on GPU by CUDA IPC both to an engine in the trainer's own worker process
  (``export_ipc_inproc_*``, the colocated layout) and in another process
  (``export_ipc_xproc_*``); on CPU by the relay path. These run with the trainer
  offloaded (its parameters come back to the device for the push);
  ``export_ipc_*_resident_s`` with the trainer resident (its parameter buffer shared in
  place: the loop's order when the GPU has room).

With ``--train-only`` only the GRPO step is measured, with ``peak_gb`` (the trainer
process's peak: GPU memory allocated, or on CPU its resident set) and, with ``--anchor``, a
transformers model of the same shape (SDPA attention, AdamW) in another process doing the
issue's anchor step: a no-grad forward (old log-probs), a forward/backward of the response
tokens' mean log-prob, an optimizer step (``anchor_*``); ``anchor_lean_*`` the same without
the no-grad forward (the work ours does). On GPU with ``--bf16`` the anchor's params and Adam
states are bf16, ours bf16 with fp32 master weights and Adam states (``anchor_precision``).
``model_tflops``: the model FLOPs of the step (:func:`train_flops`) a second; on GPU ``mfu``
against a bf16 matmul's TFLOP/s measured in the same run (``matmul_tflops``).
``--packed`` trains one packed micro-batch (``--use-dynamic-batch-size``); ``--recompute
full`` recomputes every layer in backward; ``--lengths a,b`` spreads the rows' lengths
evenly over [a, b] (a GRPO-like batch) instead of ``--seq`` each. The model's positions
cover the longest row.

    python benchmarks/trainer_bench.py                                   # CPU: tiny Qwen3, fp32
    python benchmarks/trainer_bench.py --device cuda --size 0.6b --bf16
    python benchmarks/trainer_bench.py --device cuda --size 4b --bf16 --batch 4 --seq 1024
    python benchmarks/trainer_bench.py --size tiny --batch 1 --seq 16384 --steps 1 --train-only
    python benchmarks/trainer_bench.py --device cuda --size 0.6b --bf16 --batch 1 --seq 32768 --train-only --anchor
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

GB = 1 << 30


def pinned_copy_s_per_gb(device: str, nbytes: int) -> tuple[float, float]:
    """(device->host, host->device) seconds per GiB with a pinned host buffer; on CPU a
    host-to-host copy both ways."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    out = []
    for dst, src in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        if device == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / 3 / (nbytes / GB))
    return out[0], out[1]


async def bench(args, path: str) -> dict:
    from engines.actor import EngineActor
    from engines.trainer.actor import TrainerActor
    from engines.trainer.train_batch import TrainBatch
    from relay import setup_torch_distributed, this_host

    lengths = row_lengths(args)
    seqs = [[5 + (i * 7 + j * 3) % 90 for j in range(n)] for i, n in enumerate(lengths)]
    masks = [[0] * (n // 4 - 1) + [1] * (n - n // 4) for n in lengths]
    adv = [1.0 if i % 2 else -1.0 for i in range(args.batch)]
    ekw = dict(device=args.device, kv_cache_tokens=4096, weights_mode="discard")
    if args.device == "cuda":
        ekw["dtype"] = "bfloat16" if args.bf16 else "float32"

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    await setup_torch_distributed(procs)
    recompute = ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
                 if args.recompute == "full" else None)
    t = procs.spawn("trainer", TrainerActor, path, lr=1e-6, bf16=args.bf16, pack=args.packed, recompute=recompute,
                    micro_batch_tokens=args.micro_batch_tokens or sum(lengths) if args.packed
                    else args.micro_batch_tokens or len(lengths) * max(lengths))
    await t.initialized(1200)
    out: dict = {"size": args.size, "device": args.device, "bf16": args.bf16, "batch": args.batch, "seq": args.seq,
                 "tokens": sum(lengths), "packed": args.packed, "recompute": args.recompute}
    out["optimizer"] = (await t.optimizer_info.call_one().result(60))["kind"]

    await t.train_step.call_one(TrainBatch(seqs, masks, adv)).result(1200)  # warm-up (allocates the optimizer state)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        await t.train_step.call_one(TrainBatch(seqs, masks, adv)).result(1200)
        times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(times)
    out["tokens_per_s"] = sum(lengths) / out["step_s"]
    out["peak_gb"] = (await t.gpu_memory.call_one().result(60))["peak"] / GB
    if args.train_only:
        await t.shutdown.call().result(60)
        await procs.stop()
        return out

    await t.offload.call_one().result(1200)  # first cycle allocates the host buffers
    await t.onload.call_one().result(1200)
    t0 = time.perf_counter()
    moved = await t.offload.call_one().result(1200)
    off_s = time.perf_counter() - t0
    # The weight export runs while the trainer is offloaded, as in the colocated loop.
    engines = {"inproc": procs.spawn("engine_local", EngineActor, path, "torch", **ekw)}
    eprocs = None
    nccl = args.device == "cuda" and torch.cuda.device_count() >= 2
    nprocs = None
    if args.device == "cuda":
        eprocs = this_host().spawn_procs(per_host={"gpus": 1})
        engines["xproc"] = eprocs.spawn(
            "engine_remote", EngineActor, path, "torch", **ekw
        )  # GPU 0, another process: CUDA IPC
        if nccl:  # another GPU ("gpus" is only a label: the process is pointed at GPU 1)
            nprocs = this_host().spawn_procs(per_host={"gpus": 1}, env={"CUDA_VISIBLE_DEVICES": "1"})
            engines["nccl"] = nprocs.spawn("engine_nccl", EngineActor, path, "torch", **ekw)  # the NCCL broadcast group
    await asyncio.gather(*(e.initialized(1200) for e in engines.values()))
    for name, e in engines.items():
        await e.sleep.call(["weights", "kv_cache"]).result(600)
        await e.wake.call(["weights"]).result(600)
        transport = ("distributed" if name == "nccl" else "ipc") if args.device == "cuda" else "relay"
        t0 = time.perf_counter()
        await t.push_weights.call_one([e], 1, args.bucket_mb << 20, 600.0, transport).result(1200)  # warm-up
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        sent = await t.push_weights.call_one([e], 2, args.bucket_mb << 20, 600.0, transport).result(1200)
        el = time.perf_counter() - t0
        key = (
            (f"export_{transport}_{name}" if name != "nccl" else "export_nccl")
            if args.device == "cuda"
            else "export_relay"
        )
        out[f"{key}_first_s"] = first  # the first push of a broadcast group also sets it up
        out[f"{key}_s"] = el
        out[f"{key}_s_per_gb"] = el / (sent / GB)
        out["export_gb"] = sent / GB
        if args.device != "cuda":
            break
    t0 = time.perf_counter()
    await t.onload.call_one().result(1200)
    on_s = time.perf_counter() - t0
    if args.device == "cuda":  # the loop's order when the GPU has room: the trainer resident, its buffer shared
        for name in ("inproc", "xproc"):
            await t.push_weights.call_one([engines[name]], 3, args.bucket_mb << 20, 600.0, "ipc").result(1200)
            t0 = time.perf_counter()
            sent = await t.push_weights.call_one([engines[name]], 4, args.bucket_mb << 20, 600.0, "ipc").result(1200)
            out[f"export_ipc_{name}_resident_s"] = time.perf_counter() - t0
    out["offload_gb"] = moved / GB
    out["offload_s_per_gb"] = off_s / (moved / GB)
    out["onload_s_per_gb"] = on_s / (moved / GB)
    await t.shutdown.call().result(60)
    await procs.stop()
    for p in (eprocs, nprocs):
        if p is not None:
            await p.stop()
    d2h, h2d = pinned_copy_s_per_gb(args.device, min(moved, 2 * GB))
    out["pinned_d2h_s_per_gb"], out["pinned_h2d_s_per_gb"] = d2h, h2d
    out["offload_vs_pinned"] = out["offload_s_per_gb"] / d2h
    out["onload_vs_pinned"] = out["onload_s_per_gb"] / h2d
    out["export_s_per_gb"] = out.get("export_ipc_inproc_s_per_gb", out.get("export_relay_s_per_gb"))
    return out


def train_flops(path: str, lengths: list[int]) -> float:
    """Model FLOPs of one training pass (forward + backward, 3x the forward) over rows of
    ``lengths``: the matmuls (2 per weight per token; the tied LM head counted once) and causal
    attention (``QK^T`` and ``PV`` over the keys before each query: ``4 d_q`` per pair)."""
    from engines.models.model import ModelConfig

    c = ModelConfig.from_dir(path)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    weights = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    tokens = sum(lengths)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 3 * (2 * weights * tokens + 4 * q * c.num_layers * pairs)


def row_lengths(args) -> list[int]:
    if not args.lengths:
        return [args.seq] * args.batch
    low, high = (int(x) for x in args.lengths.split(","))
    return [low + (high - low) * i // max(1, args.batch - 1) for i in range(args.batch)]


def anchor_step(args, path: str, lengths: list[int], old_forward: bool = True):
    """transformers (SDPA, AdamW) doing the GRPO step's work on rows of ``lengths``: the step
    as a function (it waits for the device). ``old_forward``: with the no-grad forward for the
    old log-probs (the issue's anchor); without it, the work ours does for a batch that is one
    optimizer step (the old log-probs are the forward's own, detached)."""
    import transformers

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = [torch.tensor([[5 + (i * 7 + j * 3) % 90 for j in range(n)]], device=device) for i, n in enumerate(lengths)]

    def step() -> None:
        for ids in rows:  # one row per forward: no padding, as ours packs or groups by length
            if old_forward:
                with torch.no_grad():
                    model(ids).logits.float().log_softmax(-1)
            logp = model(ids).logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])
            (-logp[ids.shape[1] // 4 :].mean() / len(rows)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def anchor(args, path: str, lengths: list[int], queue) -> None:
    """transformers (SDPA) doing the GRPO step's work on the same rows; puts its figures."""
    device = torch.device(args.device)
    out = {"anchor_precision": "bf16 params and AdamW states (no fp32 master)" if args.bf16 else "fp32"}
    for key, old_forward in (("anchor", True), ("anchor_lean", False)):
        step = anchor_step(args, path, lengths, old_forward)
        step()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        out.update({f"{key}_step_s": step_s, f"{key}_tokens_per_s": sum(lengths) / step_s})
        del step
        if key == "anchor":
            from engines.trainer.actor import peak_rss

            out["anchor_peak_gb"] = (torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_rss()) / GB
            if device.type == "cuda":
                torch.cuda.empty_cache()
    queue.put(out)


def run_anchor(args, path: str) -> dict:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=anchor, args=(args, path, row_lengths(args), queue))
    p.start()
    try:
        return queue.get(timeout=1800)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: reported, the other side stands
        return {"anchor_error": f"{type(e).__name__}: {e}; exit code {p.exitcode}"}
    finally:
        p.join(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=("tiny", "small", "0.6b", "4b"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--bf16", action="store_true", help="bf16 params, fp32 master weights (Megatron optimizer)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--train-only", action="store_true", help="only the GRPO step (and its peak memory)")
    ap.add_argument("--packed", action="store_true", help="one packed micro-batch (--use-dynamic-batch-size)")
    ap.add_argument("--recompute", choices=("full",), help="activation recompute of every layer")
    ap.add_argument("--lengths", help="a,b: the rows' lengths spread evenly over [a, b]")
    ap.add_argument("--micro-batch-tokens", type=int, help="tokens per micro-batch (default: the whole batch)")
    ap.add_argument("--anchor", action="store_true", help="also time transformers (SDPA) on the same rows")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "relay-trainer-bench"))
    args = ap.parse_args()
    from engines.models.model_builder import make_model

    dtype = "bfloat16" if args.bf16 else "float32"
    positions = max(4096, max(row_lengths(args)))  # the model's positions cover the longest row
    path = os.path.join(args.cache, f"qwen3-{args.size}-{dtype}-pos{positions}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_model("qwen3", args.size, path, seed=0, dtype=dtype, init_device=args.device,
                   max_position_embeddings=positions)
    out = asyncio.run(bench(args, path))
    out["model_tflops"] = train_flops(path, row_lengths(args)) / out["step_s"] / 1e12
    if args.device == "cuda":  # model FLOP utilization against this GPU's bf16 matmul, measured now
        from benchmarks.engine_bench import matmul_flops

        out["matmul_tflops"] = matmul_flops("cuda") / 1e12
        out["mfu"] = out["model_tflops"] / out["matmul_tflops"]
    if args.anchor:
        out.update(run_anchor(args, path))
        if "anchor_tokens_per_s" in out:
            out["ours_vs_anchor_tokens_per_s"] = out["tokens_per_s"] / out["anchor_tokens_per_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
