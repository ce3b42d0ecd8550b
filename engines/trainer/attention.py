"""The trainer's core attention: torch's fused ``scaled_dot_product_attention`` in Megatron's
``core_attention`` slot, in place of the local spec's ``DotProductAttention``, which
materializes the ``[heads, S, S]`` scores and keeps them with the softmax for backward.

Fused SDPA (flash / cuDNN / memory-efficient on GPU, the flash kernel on CPU) keeps memory
linear in the sequence length and computes the same causal attention: right-padded rows need
no other mask (a real token never sees the padding after it). A packed micro-batch
(``packed_seq_params``, Megatron's ``thd`` layout: the rows concatenated, ``cu_seqlens_q``
their bounds) attends within each row only, one SDPA call per row, never building a dense
``[S, S]`` mask; its RoPE positions restart per row (Megatron applies them by
``cu_seqlens``).

On CUDA, grouped-query attention runs without expanding the key / value heads
(``enable_gqa``), and a packed micro-batch in half precision is one variable-length flash
call (``torch.nn.attention.varlen``) where this torch has it, instead of one call per row."""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention import SDPBackend, sdpa_kernel


class SDPAttention(MegatronModule):
    """Causal attention of ``query`` ``[s, b, heads, d]`` over ``key`` / ``value`` ``[s, b,
    groups, d]`` (query groups repeated per head), scaled by ``1/sqrt(d)`` (or
    ``softmax_scale``); ``[s, b, heads * d]`` out. Packed (``thd``): ``[t, heads, d]`` in,
    ``[t, heads * d]`` out, attention within each row of ``packed_seq_params.cu_seqlens_q``."""

    def __init__(self, config, layer_number: int = 1, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None, **_):
        super().__init__(config=config)
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        if config.apply_query_key_layer_scaling:
            raise ValueError("SDPAttention does not scale query-key by layer (apply_query_key_layer_scaling)")

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """[b, heads, s, d] x [b, groups, s, d] -> [b, heads, s, d], causal."""
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and q.is_cuda and _FUSED_GQA[0]:  # CUDA's flash kernels take the groups as they are
            try:  # never the math fallback (it holds [S, S] scores): a fused kernel or the expansion below
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                  SDPBackend.EFFICIENT_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            except RuntimeError as e:
                if "No available kernel" not in str(e):
                    raise
                _FUSED_GQA[0] = False  # this torch / GPU / dtype has none: expand from now on
        if groups > 1:  # expanded (CPU's flash kernel does not take enable_gqa)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    def _packed(self, query, key, value, params) -> torch.Tensor:
        """``[t, heads, d]`` attention within each row of ``params.cu_seqlens_q``."""
        varlen = _varlen_attn() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
        default_scale = self.scale == 1.0 / math.sqrt(query.shape[-1])
        if varlen is not None and (varlen[3] or default_scale):
            attend, causal, gqa, takes_scale = varlen
            groups = query.shape[1] // key.shape[1]
            if groups > 1 and not gqa:
                key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
            bounds = params.cu_seqlens_q.to(torch.int32)
            extra = {"enable_gqa": True} if gqa and groups > 1 else {}
            if takes_scale:
                extra["scale"] = self.scale
            return attend(query, key, value, bounds, bounds, int(params.max_seqlen_q), int(params.max_seqlen_q),
                          **causal, **extra)
        bounds = params.cu_seqlens_q.tolist()
        parts = [self._attend(query[a:b].transpose(0, 1)[None], key[a:b].transpose(0, 1)[None],
                              value[a:b].transpose(0, 1)[None], self.scale)[0].transpose(0, 1)
                 for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        return torch.cat(parts, dim=0)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        if packed_seq_params is not None:
            out = self._packed(query, key, value, packed_seq_params)
            return out.reshape(out.shape[0], -1)
        s, b = query.shape[:2]
        out = self._attend(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), self.scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


@functools.lru_cache(maxsize=1)
def _varlen_attn():
    """``(varlen_attn, its causal keyword, whether it takes enable_gqa, whether it takes
    scale)``, or None where this torch has no ``torch.nn.attention.varlen`` (its keywords
    changed across versions)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


#: whether SDPA's fused CUDA kernels take ``enable_gqa`` here (found out at the first call)
_FUSED_GQA = [True]


def use_sdpa(spec) -> None:
    """Put :class:`SDPAttention` in every ``core_attention`` slot of a layer or block spec
    (in place)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    seen: set = set()

    def visit(node) -> None:
        if id(node) in seen or node is None:
            return
        seen.add(id(node))
        if isinstance(node, (list, tuple)):
            for item in node:
                visit(item)
            return
        for name in ("submodules", "layer_specs", "self_attention", "cross_attention"):
            visit(getattr(node, name, None))
        if getattr(node, "core_attention", None) is DotProductAttention:
            node.core_attention = SDPAttention

    visit(spec)
