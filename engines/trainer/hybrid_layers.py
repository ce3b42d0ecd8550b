"""Qwen3.5 hybrid models (``qwen3_5_moe``) in the Megatron trainer: a ``GPTModel`` whose
layers are Megatron ``TransformerLayer``s (residuals, MoE with the shared expert and its
gate, expert parallel, the vocab-parallel output and loss: all Megatron's) with three
modules of our own in them, since megatron-core 0.16's Gated DeltaNet needs
flash-linear-attention (Triton; no CPU path) and its hybrid block spec TransformerEngine:

- :class:`LinearAttention`: the Gated DeltaNet token mixer, the engine's module
  (engines/models/linear_attention.py, HF parameter names) run over whole sequences from a zero
  state (its chunked delta rule, differentiable);
- :class:`GatedAttention`: full attention with the per-head output gate, q/k RMSNorm and
  partial RoPE, the engine's maths (engines/models/hybrid_model.py ``gated_qkv``), causal SDPA;
- :class:`OffsetRMSNorm`: the zero-centred RMSNorm (scale ``1 + weight``) of every layer.

Sequences are right-padded (engines/trainer/batching.py): a causal mixer's real tokens never
see the padding after them. Positions are ``0 .. L - 1`` (RoPE is computed here; the
GPTModel has no position embedding of its own). Under tensor parallel each rank's mixer
holds its share of the heads, as the engine's does (the HF tensors sharded by
engines/models/model.py ``shard_tensor``: :func:`shard_mixer`, gathered back by
:func:`unshard_mixer`): the input enters through Megatron's copy-to-TP region, the output
projection's partial sums are reduced over TP, and the norms every head shares
(``q_norm``, ``k_norm``, the gated norm) are marked ``tp_partial_grad`` (their gradients are
summed over TP: engines/trainer/optim.py). The MTP head and the vision tower are not
trained (write_hf_checkpoint copies them from the source checkpoint).

HF names (``model.`` or, for the VL-wrapped checkpoints Qwen3.5 ships, ``model.language_model.``)
map one to one: ``layers.{i}.linear_attn.X`` / ``self_attn.X`` <-> ``decoder.layers.{i}.self_attention.X``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from engines.models.hybrid_model import gated_qkv
from engines.models.linear_attention import GatedDeltaNet
from engines.models.model import Attention, ModelConfig, _inv_freq

#: the text model's prefix in the VL-wrapped checkpoints (Qwen3_5MoeForConditionalGeneration)
VL_TEXT = "model.language_model."
#: tensors of a hybrid checkpoint the trainer does not hold (copied through when saving)
NOT_TRAINED = ("model.visual.", "mtp.")


def _params_dtype(config) -> torch.dtype:
    return getattr(config, "params_dtype", None) or torch.float32


def _cast_params(module: nn.Module, config) -> None:
    """Parameters (not buffers: RoPE's inverse frequencies stay float32) in Megatron's
    ``params_dtype``, as Megatron builds its own layers (``--bf16``: bf16 params, fp32 master
    weights in the optimizer)."""
    dtype = _params_dtype(config)
    for p in module.parameters():
        p.data = p.data.to(dtype)


class OffsetRMSNorm(nn.Module):
    """RMSNorm with the weight stored zero-centred: ``rmsnorm(x) * (1 + weight)`` in float32
    (HF's Qwen3.5 norm). Built by Megatron as ``(config, hidden_size, eps)``."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=_params_dtype(config)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, 1.0 + self.weight.float(), self.eps).to(x.dtype)


def _tp() -> tuple[int, int]:
    """(size, rank) of this process's tensor-parallel group (1, 0 without Megatron's state)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def _rank_config(cfg: ModelConfig, size: int, rank: int) -> ModelConfig:
    """``cfg`` for rank ``rank`` of ``size`` tensor-parallel ranks' share of the heads."""
    import dataclasses

    return cfg if size == 1 else dataclasses.replace(cfg, tp_size=size, tp_rank=rank)


def local_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` for this tensor-parallel rank's share of the heads (itself at TP = 1)."""
    return _rank_config(cfg, *_tp())


def _mark_partial(*params: nn.Parameter) -> None:
    for p in params:
        p.tp_partial_grad = True  # shared by every head while each rank holds some: summed over TP


def _into_tp(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(x) if cfg.tp_size > 1 else x


def _out_of_tp(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x) if cfg.tp_size > 1 else x


class LinearAttention(GatedDeltaNet):
    """A Gated DeltaNet layer as Megatron's ``self_attention``: [L, B, H] in, (output, None)
    out; this TP rank's heads (the output reduced over TP)."""

    def __init__(self, config=None, submodules=None, layer_number: int = 1, model: ModelConfig = None, **_):
        self.local = local_config(model)
        super().__init__(self.local)
        _cast_params(self, config)
        _mark_partial(self.norm.weight)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **_) -> tuple[torch.Tensor, None]:
        out = _out_of_tp(super().forward(_into_tp(hidden_states, self.local).transpose(0, 1)), self.local)
        return out.transpose(0, 1).contiguous(), None


class GatedAttention(Attention):
    """Qwen3.5's gated full attention as Megatron's ``self_attention``: causal over each
    row, RoPE on the first ``rotary_dim`` dimensions at positions ``0 .. L - 1``; this TP
    rank's heads (the output reduced over TP)."""

    def __init__(self, config=None, submodules=None, layer_number: int = 1, model: ModelConfig = None, **_):
        super().__init__(local_config(model))
        _cast_params(self, config)
        _mark_partial(self.q_norm.weight, self.k_norm.weight)
        self.register_buffer("inv_freq", _inv_freq(model), persistent=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **_) -> tuple[torch.Tensor, None]:
        cfg = self.cfg
        x = _into_tp(hidden_states, cfg).transpose(0, 1)  # [B, L, H]
        b, length = x.shape[:2]
        freqs = torch.arange(length, device=x.device).float()[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        q, k, v, gate = gated_qkv(cfg, self, x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        groups = cfg.local_heads // cfg.local_kv_heads
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(b, length, cfg.local_heads * cfg.head_dim)
        return _out_of_tp(self.o_proj(o * torch.sigmoid(gate)), cfg).transpose(0, 1).contiguous(), None


def check_hybrid(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError when the trainer cannot build this hybrid config."""
    from engines.models.linear_attention import check_shardable

    if tp > 1:
        check_shardable(cfg, tp)  # the linear-attention heads
        for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads)):
            if n % tp:
                raise ValueError(f"{cfg.arch}: {what} ({n}) do not divide over --tensor-model-parallel-size {tp}")
    if cfg.rotary_dim % 2:
        raise ValueError(f"{cfg.arch}: rotary_dim {cfg.rotary_dim} must be even")


def hybrid_block_spec(config, cfg: ModelConfig):
    """The decoder block spec: Megatron's local layer specs (MoE where HF has it) with our
    norms and token mixers in each layer, per ``cfg.layer_types``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    layers = []
    for i, spec in enumerate(block.layer_specs):
        spec = copy.deepcopy(spec)  # the specs of like layers are one object
        mixer = LinearAttention if cfg.is_linear_layer(i) else GatedAttention
        spec.submodules.input_layernorm = OffsetRMSNorm
        spec.submodules.pre_mlp_layernorm = OffsetRMSNorm
        spec.submodules.self_attention = ModuleSpec(module=mixer, params={"model": cfg})
        layers.append(spec)
    block.layer_specs = layers
    block.layer_norm = OffsetRMSNorm
    return block


def text_names(hf: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """The text model's tensors under ``model.`` names and the prefix the checkpoint used
    (``model.`` or :data:`VL_TEXT`); tensors not trained (:data:`NOT_TRAINED`) dropped."""
    prefix = VL_TEXT if any(n.startswith(VL_TEXT) for n in hf) else "model."
    out = {}
    for name, t in hf.items():
        if name.startswith(NOT_TRAINED):
            continue
        out["model." + name[len(prefix):] if name.startswith(prefix) else name] = t
    return out, prefix


def layer_renames(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    """Layer ``i``'s one-to-one (HF, Megatron) names: norms and the token mixer's tensors."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    pairs = [(h + "input_layernorm.weight", m + "input_layernorm.weight"),
             (h + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight")]
    if cfg.is_linear_layer(i):
        names = ["A_log", "dt_bias", "conv1d.weight", "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight",
                 "in_proj_b.weight", "norm.weight", "out_proj.weight"]
        return pairs + [(h + "linear_attn." + n, m + "self_attention." + n) for n in names]
    names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight", "k_norm.weight"]
    return pairs + [(h + "self_attn." + n, m + "self_attention." + n) for n in names]


def is_mixer(name: str) -> bool:
    """A token mixer's tensor (Megatron name: ``decoder.layers.{i}.self_attention.X``)."""
    return ".self_attention." in name


def _hf_name(cfg: ModelConfig, name: str) -> str:
    i = int(name.split(".")[2])
    mixer = "linear_attn" if cfg.is_linear_layer(i) else "self_attn"
    return f"model.layers.{i}.{mixer}." + name.split(".self_attention.", 1)[1]


def shard_mixer(cfg: ModelConfig, name: str, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's part of a token mixer's full tensor (the engine's sharding)."""
    from engines.models.model import shard_tensor

    return shard_tensor(_rank_config(cfg, tp, rank), _hf_name(cfg, name), tensor).clone()


def unshard_mixer(cfg: ModelConfig, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every TP rank's part (the inverse of :func:`shard_mixer`)."""
    leaf = _hf_name(cfg, name).rsplit(".", 2)[-2]
    if leaf in ("q_norm", "k_norm", "norm"):
        return parts[0]  # whole on every rank
    if leaf in ("in_proj_qkv", "conv1d"):  # each part: its q, k and v sections
        hk, hv = cfg.linear_num_key_heads // len(parts), cfg.linear_num_value_heads // len(parts)
        sizes = [hk * cfg.linear_key_head_dim] * 2 + [hv * cfg.linear_value_head_dim]
        sections = [p.split(sizes) for p in parts]
        return torch.cat([torch.cat([s[j] for s in sections]) for j in range(3)])
    if leaf in ("out_proj", "o_proj"):
        return torch.cat(parts, dim=1)
    return torch.cat(parts)  # by heads: q (with its gate), k, v, z, a, b, dt_bias, A_log
