"""Qwen3.5's hybrid text model (``qwen3_5_moe``) in the built-in engine: Gated DeltaNet
linear-attention layers (engines/models/linear_attention.py; a per-sequence state in the engine's
state pool) between gated full-attention layers (the paged KV cache holds only these:
cache layer ``j`` is the ``j``-th full-attention layer), MoE MLPs with a shared expert
(engines/models/moe.py). On CUDA the decode step runs in Triton kernels (the linear-attention
layers': engines/kernels/linear_kernels.py) and waits on nothing, so the runner captures it in CUDA
graphs; prefill's linear attention is the reference path (plain torch) on every device.
Over several GPUs (engines/builtin/tp.py) each rank holds its share of the attention heads, the
linear-attention heads (``shard_linear_tensor``), the experts and their state, and the
outputs of each token mixer and MLP are summed over the ranks, as in :class:`CausalLM`.

Full attention here differs from Qwen3's in three ways: ``q_proj`` gives each head's query
and then its output gate (``o * sigmoid(gate)`` before ``o_proj``), RoPE turns only the first
``rotary_dim`` dimensions of q and k (``partial_rotary_factor``; M-RoPE reduces to it for text,
whose positions are the same in every section), and the RMSNorms scale by ``1 + weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.kernels.paged_attention import paged_decode_attention
from engines.models.model import Attention, CausalLM, ModelConfig, _rotate_half


def gated_qkv(cfg: ModelConfig, attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [..., H, D], k and v [..., KVH, D] (normed, the first ``rotary_dim`` dims rotated
    by ``cos``/``sin`` [..., 1, rotary_dim]) and the output gate [..., H * D] of ``x`` [..., hidden]."""
    lead, d, r = x.shape[:-1], cfg.head_dim, cfg.rotary_dim
    q, gate = attn.q_proj(x).view(*lead, cfg.local_heads, 2 * d).chunk(2, dim=-1)
    q = attn.q_norm(q)
    k = attn.k_norm(attn.k_proj(x).view(*lead, cfg.local_kv_heads, d))
    v = attn.v_proj(x).view(*lead, cfg.local_kv_heads, d)

    def rope(t):
        turned = t[..., :r] * cos + _rotate_half(t[..., :r]) * sin
        return torch.cat([turned, t[..., r:]], dim=-1)

    return rope(q), rope(k), v, gate.reshape(*lead, cfg.local_heads * d)


def build_causal_lm(cfg: ModelConfig) -> CausalLM:
    """The engine's model of ``cfg``: hybrid or not."""
    return HybridCausalLM(cfg) if cfg.hybrid else CausalLM(cfg)


class HybridCausalLM(CausalLM):
    """``prefill`` and ``decode`` as :class:`CausalLM`'s (the KV cache: ``cfg.kv_layers``
    layers), plus the linear-attention state: ``state`` = (conv [Llin, N, C, K - 1], rec
    [Llin, N, Hv, Dk, Dv]) with one row per running sequence, ``rows`` [S] each sequence's row
    (padding rows: a scratch row). Prefill writes a sequence's row from scratch."""

    @torch.inference_mode()
    def prefill(self, input_ids, lens, slots, k_cache, v_cache, state, rows) -> torch.Tensor:
        cfg = self.cfg
        s_count, length = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(torch.arange(length, device=x.device), x.dtype)
        groups = cfg.local_heads // cfg.local_kv_heads
        flat_slots = slots.reshape(-1)
        conv, rec = state
        kv_i = lin_i = 0
        for layer in self.model.layers:
            r = x
            h = layer.input_layernorm(x)
            if hasattr(layer, "linear_attn"):
                x = r + self._reduce(layer.linear_attn.prefill(h, lens, conv[lin_i], rec[lin_i], rows))
                lin_i += 1
            else:
                attn = layer.self_attn
                q, k, v, gate = gated_qkv(cfg, attn, h, cos, sin)
                self._write_kv(k_cache[kv_i], v_cache[kv_i], flat_slots, k, v)
                kv_i += 1
                k, v = k.transpose(1, 2), v.transpose(1, 2)
                if groups > 1:
                    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
                o = o.transpose(1, 2).reshape(s_count, length, cfg.local_heads * cfg.head_dim)
                x = r + self._reduce(attn.o_proj(o * torch.sigmoid(gate)))
            x = x + self._reduce(layer.mlp(layer.post_attention_layernorm(x)))
        last = x[torch.arange(s_count, device=x.device), lens - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, input_ids, positions, slots, block_tables, context_lens, k_cache, v_cache, state,
               rows) -> torch.Tensor:
        cfg = self.cfg
        x = self.model.embed_tokens(input_ids)
        scale = cfg.head_dim**-0.5
        cos, sin = self._rope(positions, x.dtype)
        conv, rec = state
        kv_i = lin_i = 0
        for layer in self.model.layers:
            r = x
            h = layer.input_layernorm(x)
            if hasattr(layer, "linear_attn"):
                x = r + self._reduce(layer.linear_attn.decode(h, conv[lin_i], rec[lin_i], rows))
                lin_i += 1
            else:
                attn = layer.self_attn
                q, k, v, gate = gated_qkv(cfg, attn, h, cos, sin)
                self._write_kv(k_cache[kv_i], v_cache[kv_i], slots, k, v)
                o = paged_decode_attention(q, k_cache[kv_i], v_cache[kv_i], block_tables, context_lens, scale)
                kv_i += 1
                x = r + self._reduce(attn.o_proj(o.reshape(-1, cfg.local_heads * cfg.head_dim) * torch.sigmoid(gate)))
            x = x + self._reduce(layer.mlp(layer.post_attention_layernorm(x)))
        return self._logits(x)
