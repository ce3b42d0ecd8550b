"""The decode step of a dense-attention model (Qwen2/3, Llama, Qwen3-MoE, Qwen3-VL text) with
its per-layer work in few kernels, for CUDA (or Triton's interpreter). Per layer:

    rms_norm (+ residual) -> one q/k/v GEMM -> qkv_rope_write -> paged attention -> o GEMM
    -> rms_norm (+ residual) -> one gate/up GEMM -> silu_mul -> down GEMM   (MoE: its block)

``qkv_rope_write`` is one kernel for what took five: the q and k heads' RMSNorm and rotary
embedding, and K and V written straight into their cache slots.

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

from engines.kernels import skinny_gemm
from engines.kernels.paged_attention import paged_decode_attention, pdl_launch, rms_norm, silu_mul, triton
from engines.models.moe import SparseMoE

if triton is not None:
    import triton.language as tl

    from engines.kernels.paged_attention import normed_rotated

    @triton.jit
    def _qkv_rope_kernel(
        QKV, QW, KW, POS, INV, SLOTS, QOUT, KC, VC,
        s_b, s_qob, s_qoh, s_cs, s_ch, eps,
        H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr,
        NORM: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # a programmatic dependent launch (pdl_launch): nothing read before the wait
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0)
        j = tl.program_id(1)  # a query head (j < H) or a KV head (j - H)
        half: tl.constexpr = D // 2
        i = tl.arange(0, HALF_P)
        mask = i < half
        row = QKV + b * s_b
        is_q = j < H
        kvh = tl.maximum(j - H, 0)
        slot = tl.load(SLOTS + b).to(tl.int64)
        # as kernels._norm_rope_kernel: a query head with q_norm, a key head with k_norm
        out1, out2 = normed_rotated(row + tl.where(is_q, j * D, H * D + kvh * D), tl.where(is_q, QW, KW),
                                    tl.load(POS + b), INV, eps, D, HALF_P, NORM)
        if is_q:
            out = QOUT + b * s_qob + j * s_qoh
            tl.store(out + i, out1.to(QOUT.dtype.element_ty), mask=mask)
            tl.store(out + half + i, out2.to(QOUT.dtype.element_ty), mask=mask)
        else:
            out = KC + slot * s_cs + kvh * s_ch
            tl.store(out + i, out1.to(KC.dtype.element_ty), mask=mask)
            tl.store(out + half + i, out2.to(KC.dtype.element_ty), mask=mask)
            d = tl.arange(0, D_P)
            v = tl.load(row + (H + KVH) * D + kvh * D + d, mask=d < D, other=0.0)
            tl.store(VC + slot * s_cs + kvh * s_ch + d, v.to(VC.dtype.element_ty), mask=d < D)


def qkv_rope_write(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                   positions: torch.Tensor, inv_freq: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, heads: int, kv_heads: int, eps: float) -> torch.Tensor:
    """From one decode step's packed projections ``qkv`` [B, (H + 2 KVH) D] (q heads, k
    heads, v heads): the queries [B, H, D] (RMSNorm with ``q_norm`` unless None, then the
    rotary embedding at ``positions`` [B]); each token's k (``k_norm``, rotary) and v written
    to cache slot ``slots[b]`` of ``k_cache`` / ``v_cache`` [N, P, KVH, D] (contiguous)."""
    b = qkv.shape[0]
    _, _, kvh, d = k_cache.shape
    assert kvh == kv_heads and qkv.shape[1] == (heads + 2 * kv_heads) * d and qkv.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert (q_norm is None) == (k_norm is None)
    q = torch.empty((b, heads, d), dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    _qkv_rope_kernel[(b, heads + kv_heads)](
        qkv, q_norm if norm else qkv, k_norm if norm else qkv, positions, inv_freq, slots, q, k_cache, v_cache,
        qkv.stride(0), q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), eps,
        H=heads, KVH=kv_heads, D=d, HALF_P=triton.next_power_of_2(d // 2), D_P=triton.next_power_of_2(d),
        NORM=norm, num_warps=1, **pdl_launch(qkv.device),
    )
    return q


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
    docstring): [B, vocab] logits in the model's dtype (the sampler reads them as float32)."""
    if few_rows(model, x):
        return _decode_few_rows(model, x, positions, slots, block_tables, context_lens, k_cache, v_cache)
    cfg = model.cfg
    b, h, d = x.shape[0], cfg.local_heads, cfg.head_dim
    scale = d**-0.5

    def attend(i: int, q: torch.Tensor) -> torch.Tensor:
        o = paged_decode_attention(q, k_cache[i], v_cache[i], block_tables, context_lens, scale)
        return o.view(b, h * d)

    x, residual = _layers(model, x, positions, slots, k_cache, v_cache, attend)
    hidden, _ = rms_norm(x, model.model.norm.weight, cfg.rms_norm_eps, residual=residual)
    return model._vocab(model.lm_head(hidden), keep_dtype=True)


def _layers(model: nn.Module, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache, v_cache,
            attend) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer over the token rows ``x`` [N, hidden] (at ``positions``, their K/V
    written to ``slots``): ``attend(layer index, q [N, H, D])`` gives the attention output
    [N, H D] (decode: the paged kernel; prefill: SDPA). Returns the last MLP output and the
    residual sum before it (the final RMSNorm adds them)."""
    cfg = model.cfg
    h, kvh, eps = cfg.local_heads, cfg.local_kv_heads, cfg.rms_norm_eps
    residual = None
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if residual is None:
            hidden, residual = rms_norm(x, layer.input_layernorm.weight, eps), x
        else:
            hidden, residual = rms_norm(x, layer.input_layernorm.weight, eps, residual=residual)
        norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (None, None)
        q = qkv_rope_write(_qkv(attn, hidden), *norms, positions, model.inv_freq, slots, k_cache[i], v_cache[i],
                           h, kvh, eps)
        hidden, residual = rms_norm(model._reduce(attn.o_proj(attend(i, q))), layer.post_attention_layernorm.weight,
                                    eps, residual=residual)
        mlp = layer.mlp
        x = model._reduce(mlp(hidden) if isinstance(mlp, SparseMoE) else _mlp(mlp, hidden))
    return x, residual


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
    projection (6 kernels a layer)."""
    cfg = model.cfg
    b, h, kvh, d, eps = x.shape[0], cfg.local_heads, cfg.local_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    linear = skinny_gemm.skinny_linear
    residual = None
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if residual is None:
            qkv, residual = linear(x, attn.qkv_weight, attn.qkv_bias, norm_weight=layer.input_layernorm.weight,
                                   eps=eps), x
        else:
            qkv, residual = linear(x, attn.qkv_weight, attn.qkv_bias, norm_weight=layer.input_layernorm.weight,
                                   residual=residual, eps=eps)
        norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (None, None)
        q = qkv_rope_write(qkv, *norms, positions, model.inv_freq, slots, k_cache[i], v_cache[i], h, kvh, eps)
        o = paged_decode_attention(q, k_cache[i], v_cache[i], block_tables, context_lens, d**-0.5)
        o = model._reduce(linear(o.view(b, h * d), attn.o_proj.weight, attn.o_proj.bias))
        gate_up, residual = linear(o, mlp.gate_up_weight, norm_weight=layer.post_attention_layernorm.weight,
                                   residual=residual, eps=eps)
        x = model._reduce(linear(gate_up, mlp.down_proj.weight, silu_input=True))
    logits, _ = linear(x, model.lm_head.weight, model.lm_head.bias, norm_weight=model.model.norm.weight,
                       residual=residual, eps=eps)
    return model._vocab(logits, keep_dtype=True)


def prefill_fits(model: nn.Module) -> bool:
    """Whether :func:`prefill_fused` serves ``model`` (its norms, attention and rotary
    embedding are the ones the fused kernels compute: no zero-centred norm weights, no gated
    attention, the rotary embedding over the whole head)."""
    cfg = model.cfg
    return not cfg.norm_offset and not cfg.attn_output_gate and cfg.rotary_dim == cfg.head_dim


def prefill_fused(model: nn.Module, input_ids: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """``CausalLM.prefill`` with the decode step's kernels over every token (see the module
    docstring; :func:`prefill_fits` says which models): per layer one RMSNorm kernel (with the
    residual sum), one q/k/v GEMM, ``qkv_rope_write`` (q/k norms, rotary, K/V into their
    slots), causal attention over the written K/V (grouped-query heads unexpanded), one o GEMM,
    one RMSNorm kernel, one gate/up GEMM, ``silu_mul``, the down GEMM. Same roundings as a
    decode step of the same tokens. Returns each prompt's last-token logits [S, vocab] float32."""
    cfg = model.cfg
    s_count, length = input_ids.shape
    h, kvh, d = cfg.local_heads, cfg.local_kv_heads, cfg.head_dim
    x = model.model.embed_tokens(input_ids).view(s_count * length, -1)
    positions = torch.arange(length, device=x.device).repeat(s_count)
    flat_slots = slots.reshape(-1)

    def attend(i: int, q: torch.Tensor) -> torch.Tensor:
        # the K/V just written, read back per token (padding: the scratch slot, seen by padding only)
        k = k_cache[i].view(-1, kvh, d).index_select(0, flat_slots).view(s_count, length, kvh, d)
        v = v_cache[i].view(-1, kvh, d).index_select(0, flat_slots).view(s_count, length, kvh, d)
        # right padding needs no mask: a real token never sees a later position
        o = torch.nn.functional.scaled_dot_product_attention(
            q.view(s_count, length, h, d).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=h != kvh)
        return o.transpose(1, 2).reshape(s_count * length, h * d)

    x, residual = _layers(model, x, positions, flat_slots, k_cache, v_cache, attend)
    last = torch.arange(s_count, device=x.device) * length + lens.to(x.device) - 1
    hidden, _ = rms_norm(x[last], model.model.norm.weight, cfg.rms_norm_eps, residual=residual[last])
    return model._vocab(model.lm_head(hidden))
