"""The decode step of a dense-attention model (Qwen2/3, Llama, Qwen3-MoE, Qwen3-VL text) with
its per-layer work in few kernels, for CUDA (or Triton's interpreter). Per layer:

    rms_norm (+ residual) -> one q/k/v GEMM -> rope_decode_attention -> o GEMM
    -> rms_norm (+ residual) -> one gate/up GEMM -> silu_mul -> down GEMM   (MoE: its block)

``rope_decode_attention`` (engines/decode_attention.py) is one kernel for what took six: the
q and k heads' RMSNorm and rotary embedding, K and V written straight into their cache slots,
and the paged attention (a batch that splits each context combines the splits in it too).

The single GEMMs read packed weights: :func:`pack_projections` lays each layer's q/k/v weights
(and biases) out as consecutive rows of one tensor and its gate/up weights likewise; the
parameters become views of those rows, so loading, weight updates and sleep see the same
parameters as before. It runs after every (re)allocation of the parameters;
:func:`unpack_projections` drops the packed tensors with them. A model whose weights were not
packed (built outside the engine's runner, as some tests do) runs the separate GEMMs: same maths.
"""

from __future__ import annotations

import torch
from torch import nn

from . import skinny_gemm
from .decode_attention import rope_decode_attention, split_counters
from .kernels import rms_norm, silu_mul
from .moe import SparseMoE


def _pack(parts: list[nn.Parameter | None], keep_values: bool) -> torch.Tensor | None:
    """One tensor whose row blocks are ``parts`` (in order; their values copied in when
    ``keep_values``); each part becomes a view of its rows. None when any part is None (no
    bias)."""
    if any(p is None for p in parts):
        return None
    if keep_values:
        with torch.no_grad():
            packed = torch.cat([p.data for p in parts])
    else:
        packed = parts[0].new_empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
    start = 0
    for p in parts:
        p.data = packed[start:start + p.shape[0]]
        start += p.shape[0]
    return packed


def pack_projections(model: nn.Module, keep_values: bool = True) -> None:
    """Pack every dense-attention layer's q/k/v (an output-gated attention's excepted) and
    every dense MLP's gate/up (see the module docstring); the parameters' values are kept
    unless ``keep_values`` is False (freshly allocated parameters, filled afterwards)."""
    model.__dict__["_few_rows_fit"] = None  # few_rows checks the packing again
    if model.cfg.attn_output_gate:
        return
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and attn.q_proj.weight.numel():
            attn.qkv_weight = _pack([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], keep_values)
            attn.qkv_bias = _pack([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], keep_values)
        mlp = layer.mlp
        if not isinstance(mlp, SparseMoE) and mlp.gate_proj.weight.numel():
            mlp.gate_up_weight = _pack([mlp.gate_proj.weight, mlp.up_proj.weight], keep_values)


def unpack_projections(model: nn.Module) -> None:
    """Forget the packed tensors (the parameters' memory is being released)."""
    model.__dict__["_few_rows_fit"] = None
    for layer in model.model.layers:
        for module, names in ((getattr(layer, "self_attn", None), ("qkv_weight", "qkv_bias")),
                              (layer.mlp, ("gate_up_weight",))):
            for name in names:
                if module is not None and hasattr(module, name):
                    setattr(module, name, None)


def _qkv(attn: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """[B, (H + 2 KVH) D]: the packed GEMM, or the three GEMMs side by side."""
    weight = getattr(attn, "qkv_weight", None)
    if weight is not None:
        return torch.nn.functional.linear(hidden, weight, getattr(attn, "qkv_bias", None))
    return torch.cat([attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)], dim=-1)


def _mlp(mlp: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    weight = getattr(mlp, "gate_up_weight", None)
    if weight is None:
        return mlp.down_proj(silu_mul(mlp.gate_proj(hidden), mlp.up_proj(hidden)))
    gate_up = torch.nn.functional.linear(hidden, weight)
    n = gate_up.shape[1] // 2
    return mlp.down_proj(silu_mul(gate_up[:, :n], gate_up[:, n:]))


def decode_fused(model: nn.Module, x: torch.Tensor, positions, slots, block_tables, context_lens, k_cache,
                 v_cache) -> torch.Tensor:
    """``CausalLM.decode`` from the embedded tokens ``x`` [B, hidden] on (see the module
    docstring): [B, vocab] float32 logits."""
    if few_rows(model, x):
        return _decode_few_rows(model, x, positions, slots, block_tables, context_lens, k_cache, v_cache)
    cfg = model.cfg
    b, h, kvh, d, eps = x.shape[0], cfg.local_heads, cfg.local_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    scale = d**-0.5
    residual = None
    counters = split_counters(b, kvh, x.device, len(model.model.layers))
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if residual is None:
            hidden, residual = rms_norm(x, layer.input_layernorm.weight, eps), x
        else:
            hidden, residual = rms_norm(x, layer.input_layernorm.weight, eps, residual=residual)
        norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (None, None)
        o = rope_decode_attention(_qkv(attn, hidden), *norms, positions, model.inv_freq, slots, k_cache[i],
                                  v_cache[i], block_tables, context_lens, h, scale, eps,
                                  None if counters is None else counters[i])
        hidden, residual = rms_norm(
            model._reduce(attn.o_proj(o.view(b, h * d))), layer.post_attention_layernorm.weight, eps,
            residual=residual,
        )
        mlp = layer.mlp
        x = model._reduce(mlp(hidden) if isinstance(mlp, SparseMoE) else _mlp(mlp, hidden))
    hidden, _ = rms_norm(x, model.model.norm.weight, eps, residual=residual)
    return model._vocab(model.lm_head(hidden))


def few_rows(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether the step of ``x``'s rows runs :func:`_decode_few_rows`: at most
    ``skinny_gemm.MAX_ROWS`` rows, every layer dense with packed q/k/v and gate/up weights
    (checked once per packing)."""
    if not (x.dim() == 2 and 0 < x.shape[0] <= skinny_gemm.MAX_ROWS and x.is_contiguous()):
        return False
    fits = model.__dict__.get("_few_rows_fit")
    if fits is None:
        fits = model.__dict__["_few_rows_fit"] = _layers_fit(model, x[:1])
    return fits


def _layers_fit(model: nn.Module, row: torch.Tensor) -> bool:
    for layer in model.model.layers:
        attn, mlp = getattr(layer, "self_attn", None), layer.mlp
        weights = (getattr(attn, "qkv_weight", None), getattr(mlp, "gate_up_weight", None))
        if any(w is None for w in weights) or isinstance(mlp, SparseMoE):
            return False
        if not all(skinny_gemm.usable(row, w) for w in (*weights, attn.o_proj.weight, mlp.down_proj.weight)):
            return False
    return skinny_gemm.usable(row, model.lm_head.weight)


def _decode_few_rows(model, x, positions, slots, block_tables, context_lens, k_cache, v_cache) -> torch.Tensor:
    """:func:`decode_fused` for a few rows: every projection a ``skinny_gemm`` kernel, the
    RMSNorms folded into the q/k/v, gate/up and head projections and ``silu_mul`` into the down
    projection (5 kernels a layer)."""
    cfg = model.cfg
    b, h, kvh, d, eps = x.shape[0], cfg.local_heads, cfg.local_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    linear = skinny_gemm.skinny_linear
    residual = None
    counters = split_counters(b, kvh, x.device, len(model.model.layers))
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if residual is None:
            qkv, residual = linear(x, attn.qkv_weight, attn.qkv_bias, norm_weight=layer.input_layernorm.weight,
                                   eps=eps), x
        else:
            qkv, residual = linear(x, attn.qkv_weight, attn.qkv_bias, norm_weight=layer.input_layernorm.weight,
                                   residual=residual, eps=eps)
        norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (None, None)
        o = rope_decode_attention(qkv, *norms, positions, model.inv_freq, slots, k_cache[i], v_cache[i],
                                  block_tables, context_lens, h, d**-0.5, eps,
                                  None if counters is None else counters[i])
        o = model._reduce(linear(o.view(b, h * d), attn.o_proj.weight, attn.o_proj.bias))
        gate_up, residual = linear(o, mlp.gate_up_weight, norm_weight=layer.post_attention_layernorm.weight,
                                   residual=residual, eps=eps)
        x = model._reduce(linear(gate_up, mlp.down_proj.weight, silu_input=True))
    logits, _ = linear(x, model.lm_head.weight, model.lm_head.bias, norm_weight=model.model.norm.weight,
                       residual=residual, eps=eps)
    return model._vocab(logits)
