"""The trainer's fused elementwise ops, served where megatron-core looks for
TransformerEngine's (none here): RoPE (``rope_utils.fused_apply_rotary_pos_emb[_thd]``, used
with ``TransformerConfig.apply_rope_fusion``) and SwiGLU (``mlp.bias_swiglu_impl``, used
with ``bias_activation_fusion``), by engines/kernels/rope.py and swiglu.py; and RMSNorm
(:func:`fuse_norms`: the model's ``torch.nn.RMSNorm`` modules, Megatron's local-spec norm,
become :class:`FusedRMSNorm`, engines/kernels/rms_norm.py). :func:`install` runs before the
TransformerConfig is built (its checks look for the RoPE hook). Cases the kernels do not
cover (interleaved or partial rotary dimensions, context parallelism, a bias, FP8 or
offloaded activations), and every call where no kernel runs (CPU: there the ops are
megatron-core's and torch's own, gradients bit for bit), go to megatron-core's own code;
where TransformerEngine is installed its RoPE stays. ``RELAY_TRAINER_FUSIONS=0`` in the trainer's environment keeps
megatron-core's unfused code (for comparisons)."""

from __future__ import annotations

import torch

from engines.kernels import rms_norm, rope, swiglu

_MEGATRON_SWIGLU: list = [None]


def rope_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, **kwargs) -> torch.Tensor:
    """megatron-core's ``fused_apply_rotary_pos_emb`` (``t`` ``[S, B, H, D]``)."""
    if interleaved or kwargs or not rope.covers(t, freqs) or freqs.shape[0] < t.shape[0] or not rope.runs(t):
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    return rope.rope(t, freqs)


def rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1, cp_rank: int = 0,
             **kwargs) -> torch.Tensor:
    """megatron-core's ``fused_apply_rotary_pos_emb_thd`` (``t`` ``[T, H, D]``, one packed row):
    where the angles cover exactly the packed tokens, token ``i`` takes angle row ``i``
    (Megatron's offset mapping), else each sequence's tokens take rows ``0, 1, ...``."""
    if cp_size != 1 or kwargs or not rope.covers(t, freqs) or not rope.runs(t):
        from megatron.core import parallel_state
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs,
                                                    cp_group=parallel_state.get_context_parallel_group())
    tokens = t.shape[0]
    positions = None if freqs.shape[0] == tokens else rope.packed_positions(cu_seqlens, tokens)
    return rope.rope(t[:, None], freqs, positions)[:, 0]


def bias_swiglu(x: torch.Tensor, bias, fp8_input_store: bool = False, cpu_offload_input: bool = False):
    """megatron-core's ``bias_swiglu_impl``."""
    if bias is not None or fp8_input_store or cpu_offload_input:
        return _MEGATRON_SWIGLU[0](x, bias, fp8_input_store, cpu_offload_input)
    return swiglu.swiglu(x)


def enabled() -> bool:
    """``RELAY_TRAINER_FUSIONS`` (engines/settings.py): not ``0``."""
    from engines.settings import settings

    return settings().trainer_fusions


def install() -> dict:
    """Serve megatron-core's hooks; the TransformerConfig options that turn them on."""
    if not enabled():
        return {"apply_rope_fusion": False, "bias_activation_fusion": False}
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import mlp

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rope_bshd
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = rope_thd
    if mlp.bias_swiglu_impl is not bias_swiglu:
        _MEGATRON_SWIGLU[0] = mlp.bias_swiglu_impl
        mlp.bias_swiglu_impl = bias_swiglu
    return {"apply_rope_fusion": True, "bias_activation_fusion": True}


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same parameters, same state dict) computed by one kernel each way."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or tuple(self.normalized_shape) != tuple(x.shape[-1:]):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm.rms_norm(x, self.weight, eps)


def fuse_norms(model: torch.nn.Module) -> int:
    """Make every plain ``torch.nn.RMSNorm`` of ``model`` a :class:`FusedRMSNorm` (in place:
    parameters and hooks stay); how many."""
    if not enabled():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.RMSNorm:
            module.__class__ = FusedRMSNorm
            count += 1
    return count
