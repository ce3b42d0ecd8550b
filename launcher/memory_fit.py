"""The plan-time memory estimate of every inference engine: its weights and the KV cache of
one full-length sequence, per GPU, against the memory its fraction gives it.

A layout that cannot fit is refused before anything starts, with the arithmetic; one that
fits gets a line with the numbers in the plan; where a model's ``config.json`` cannot be
read, or the GPU's memory is unknown (no ``--gpu-memory-gb`` and no GPU on the planning
machine), the plan says the fit was not checked. Only JSON and file sizes are read (no
torch import): the weights are the checkpoint's ``*.safetensors`` / ``*.bin`` bytes, else
estimated from ``config.json`` (parameters x its dtype, FP8 when quantized so)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from dataclasses import dataclass

GIB = 1 << 30
#: the KV cache's element size (bf16), as both engines keep it
KV_BYTES = 2
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass
class ModelSize:
    weight_bytes: int
    kv_bytes_per_token: int  # every full-attention layer's K and V of one token (all KV heads)
    kv_heads: int
    measured: bool  # weights from the checkpoint's files (else estimated from config.json)
    params: int = 0  # estimated from config.json
    layers: int = 0
    hidden: int = 0
    intermediate: int = 0  # a dense MLP's, or the experts' routed per token (top-k x moe size)
    vocab: int = 0
    moe: bool = False  # routed experts
    hybrid: bool = False  # linear-attention layers among the full ones


def text_config(path: str) -> dict | None:
    """``config.json`` of a checkpoint directory (a VL checkpoint's ``text_config``), or None."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict):
        return None
    inner = d.get("text_config")
    return {**d, **inner} if isinstance(inner, dict) else d


def model_size(path: str) -> ModelSize | None:
    """The weights and per-token KV of the checkpoint at ``path``; None when its config
    cannot be read or lacks the shape."""
    d = text_config(path)
    if d is None:
        return None
    try:
        layers, hidden, heads = int(d["num_hidden_layers"]), int(d["hidden_size"]), int(d["num_attention_heads"])
        kv = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError):
        return None
    types = d.get("layer_types")
    if isinstance(types, list) and types:
        full = sum(t == "full_attention" for t in types)
    elif d.get("full_attention_interval"):
        full = layers // int(d["full_attention_interval"])
    else:
        full = layers
    files = [f for pattern in ("*.safetensors", "*.bin") for f in glob.glob(os.path.join(path, pattern))]
    params = _estimated_params(d, layers, hidden, heads, kv, head_dim)
    weights = sum(os.path.getsize(f) for f in files) or params * _dtype_bytes(d)
    experts = int(d.get("num_experts_per_tok") or 0) if (d.get("num_experts") or d.get("n_routed_experts")) else 0
    inter = experts * int(d.get("moe_intermediate_size") or 0) + int(d.get("shared_expert_intermediate_size") or 0) \
        if experts else int(d.get("intermediate_size") or 4 * hidden)
    return ModelSize(int(weights), 2 * full * kv * head_dim * KV_BYTES, kv, bool(files), params, layers, hidden,
                     inter, int(d.get("vocab_size") or 0), moe=bool(experts), hybrid=full < layers)


def _estimated_params(d: dict, layers: int, hidden: int, heads: int, kv: int, head_dim: int) -> int:
    """Parameters of a decoder from its config: attention (a gated query doubles q, as
    Qwen3.5's), linear-attention layers (Gated DeltaNet's projections), dense or MoE MLPs with a
    shared expert, multi-token-prediction layers, embeddings, and a vision tower's blocks where
    there is one."""
    gated = bool(d.get("attn_output_gate")) or str(d.get("model_type", "")).startswith(("qwen3_5", "qwen3_next"))
    attention = hidden * heads * head_dim * (3 if gated else 2) + 2 * hidden * kv * head_dim
    keys = int(d.get("linear_key_head_dim") or 0) * int(d.get("linear_num_key_heads") or 0)
    values = int(d.get("linear_value_head_dim") or 0) * int(d.get("linear_num_value_heads") or 0)
    linear = hidden * (2 * keys + 3 * values) + 2 * hidden * int(d.get("linear_num_value_heads") or 0)
    types = d.get("layer_types") if isinstance(d.get("layer_types"), list) else []
    n_linear = sum(t == "linear_attention" for t in types)
    experts = d.get("num_experts") or d.get("n_routed_experts") or d.get("num_local_experts")
    if experts:
        inter = int(d.get("moe_intermediate_size") or d.get("intermediate_size"))
        shared = int(d.get("shared_expert_intermediate_size") or 0)
        mlp = 3 * hidden * inter * int(experts) + hidden * int(experts)
        mlp += 3 * hidden * shared + hidden if shared else 0
    else:
        mlp = 3 * hidden * int(d.get("intermediate_size") or 4 * hidden)
    vocab = int(d.get("vocab_size") or 0)
    # multi-token-prediction layers (full attention, an MLP, a fusing projection): Qwen3.5 ships one
    qwen35 = str(d.get("model_type", "")).startswith("qwen3_5")
    mtp = int(d.get("mtp_num_hidden_layers") or d.get("num_nextn_predict_layers") or (1 if qwen35 else 0))
    total = (layers - n_linear) * attention + n_linear * linear + layers * mlp
    total += mtp * (attention + mlp + 2 * hidden * hidden)
    total += vocab * hidden * (1 if d.get("tie_word_embeddings") else 2)
    vision = d.get("vision_config")
    if isinstance(vision, dict) and vision.get("hidden_size"):
        vh, vi = int(vision["hidden_size"]), int(vision.get("intermediate_size") or 4 * vision["hidden_size"])
        merged = vh * int(vision.get("spatial_merge_size") or 1) ** 2
        total += int(vision.get("depth") or 0) * (4 * vh * vh + 2 * vh * vi) + merged * merged + merged * hidden
    return total


def _dtype_bytes(d: dict) -> int:
    quant = d.get("quantization_config") or {}
    if isinstance(quant, dict) and "fp8" in str(quant.get("quant_method", "")).lower():
        return 1
    return DTYPE_BYTES.get(str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"), 2)


def gpu_memory_bytes(cfg) -> tuple[int | None, str]:
    """(bytes of one GPU, where the figure comes from): ``--gpu-memory-gb``, else the planning
    machine's first GPU (nvidia-smi), else (None, why)."""
    if cfg.gpu_memory_gb is not None:
        return int(cfg.gpu_memory_gb * GIB), f"--gpu-memory-gb {cfg.gpu_memory_gb:g}"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20).stdout.split()
            return int(float(out[0]) * (1 << 20)), "this machine's GPU 0 (nvidia-smi)"
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    return None, "no --gpu-memory-gb and no GPU on this machine"


def engine_models(cfg, plan) -> list[tuple[str, str, int, float, int, str]]:
    """(label, model path, GPUs per engine, memory fraction, context tokens, what the context
    is) of each engine claim of ``plan``."""
    out = []
    for claim in plan.claims:
        if claim.role == "rollout":
            out.append((claim.label(), cfg.hf_checkpoint, claim.gpus_per_engine, claim.mem_fraction,
                        cfg.rollout_max_response_len,
                        "one --rollout-max-response-len response (its prompt not counted)"))
        elif claim.role == "genrm":
            inst = cfg.genrm[claim.instance]
            context = int(inst.engine_config.get("max_context_len") or inst.engine_config.get("context_length") or 8192)
            out.append((claim.label(), inst.model_path, claim.gpus_per_engine, claim.mem_fraction, context,
                        "one max_context_len context"))
    return out


def check_memory_fit(cfg, plan) -> list[str]:
    """The plan's memory lines (see the module docstring); ValueError with the arithmetic for
    an engine whose weights and one full context exceed its share of a GPU."""
    if plan.device == "cpu":
        return ["memory fit: not checked (CPU bundles: engines take --kv-cache-tokens of KV)"]
    total, source = gpu_memory_bytes(cfg)
    lines = []
    for label, path, gpus, fraction, context, what in engine_models(cfg, plan):
        size = model_size(path) if path else None
        if size is None:
            lines.append(f"memory fit of {label}: not checked (cannot read {path}/config.json)")
            continue
        if total is None:
            lines.append(f"memory fit of {label}: not checked ({source}; say --gpu-memory-gb N)")
            continue
        fraction = fraction if fraction is not None else cfg.sglang_mem_fraction_static
        weights = size.weight_bytes / gpus
        kv_token = size.kv_bytes_per_token * -(-size.kv_heads // gpus) / size.kv_heads  # KV heads split by TP
        kv = kv_token * context
        budget = fraction * total
        how = "" if size.measured else " (estimated from config.json)"
        arithmetic = (f"weights {size.weight_bytes / GIB:.1f} GiB{how} / {gpus} GPU(s) = {weights / GIB:.2f} GiB per "
                      f"GPU + KV of {what} ({context:,} tokens x {kv_token / 1024:.1f} KiB) = {kv / GIB:.2f} GiB: "
                      f"{(weights + kv) / GIB:.2f} GiB against {fraction:g} x {total / GIB:.1f} GiB = "
                      f"{budget / GIB:.2f} GiB ({source})")
        if weights + kv > budget:
            raise ValueError(
                f"{label} engines cannot fit: {arithmetic}. Give each engine more GPUs (--rollout-num-gpus-per-engine "
                "/ --genrm-num-gpus-per-engine), a larger memory fraction (--sglang-mem-fraction-static / the "
                "judge's engine_config mem_fraction_static), a shorter context, or a smaller model")
        lines.append(f"memory fit of {label}: {arithmetic}; room for {int((budget - weights) // kv_token):,} KV "
                     "tokens per engine")
    return lines + trainer_fit(cfg, plan, total, source)


def trainer_fit(cfg, plan, total: int | None, source: str) -> list[str]:
    """The trainer's line: per GPU, its weights, gradients and optimizer states plus the
    activations of one micro-batch (``--micro-batch-tokens`` / ``--max-tokens-per-gpu``, the
    automatic size when neither is given, or the longest response when longer) and one chunk
    of logits, against the whole GPU (the trainer has it while it trains); the arithmetic is
    engines/trainer/memory.py's. ValueError with the arithmetic when it cannot fit."""
    from engines.trainer import memory

    size = model_size(cfg.hf_checkpoint) if cfg.hf_checkpoint else None
    if size is None or not size.params:
        return [f"memory fit of the trainer: not checked (cannot read {cfg.hf_checkpoint}/config.json)"]
    if total is None:
        return [f"memory fit of the trainer: not checked ({source}; say --gpu-memory-gb N)"]
    tp = cfg.tensor_model_parallel_size
    dp = max(1, cfg.actor_total // tp)
    full = cfg.recompute_granularity == "full"
    per_param = memory.state_bytes_per_param(cfg.bf16, dp)
    states = size.params / tp * per_param
    micro = cfg.micro_batch_tokens
    chosen = ""
    if micro is None and not memory.sized_to_the_gpu(size.moe, size.hybrid):
        micro = memory.CPU_MICRO_BATCH_TOKENS
    elif micro is None:
        micro = memory.auto_micro_batch_tokens(
            total, size.params // tp, hidden=size.hidden, intermediate=size.intermediate, layers=size.layers,
            vocab=size.vocab, tp=tp, dp=dp, bf16=cfg.bf16, full_recompute=full)
        chosen = f" (micro-batch tokens automatic: {micro:,}; the trainer sizes them on its own GPU)"
    tokens = max(micro, cfg.rollout_max_response_len)
    per_token = memory.activation_bytes_per_token(size.hidden, size.intermediate, size.layers, tp, cfg.bf16, full)
    activations = tokens * per_token
    per_layer = memory.activation_bytes_per_token(size.hidden, size.intermediate, 1, tp, cfg.bf16)
    how = "full recompute: layer inputs + one layer" if full else \
        f"{size.layers} layers x {per_layer / 1024:.1f} KiB per token"
    logits = memory.logit_bytes(tokens, size.vocab, size.hidden, tp, cfg.bf16)
    need = states + activations + logits
    arithmetic = (f"{size.params / 1e9:.2f}B params / TP {tp} x {per_param:.1f} B (weights, grads, optimizer) = "
                  f"{states / GIB:.2f} GiB + activations of {tokens:,} tokens ({how}) = {activations / GIB:.2f} GiB "
                  f"+ a logit chunk {logits / GIB:.2f} GiB = {need / GIB:.2f} GiB against {total / GIB:.1f} GiB "
                  f"({source})")
    if need > total:
        raise ValueError(f"the trainer cannot fit: {arithmetic}. Lower --max-tokens-per-gpu / --micro-batch-tokens, "
                         "turn on --recompute-granularity full (--recompute-method uniform --recompute-num-layers 1), "
                         "or raise --tensor-model-parallel-size")
    return [f"memory fit of the trainer (estimate): {arithmetic}{chosen}"]
