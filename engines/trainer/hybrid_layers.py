"""Qwen3.5 hybrid models (``qwen3_5_moe``) in the Megatron trainer: a ``GPTModel`` whose
layers are Megatron ``TransformerLayer``s (residuals, MoE with the shared expert and its
gate, expert parallel, the vocab-parallel output and loss: all Megatron's) with three
modules of our own in them, since megatron-core 0.16's Gated DeltaNet needs
flash-linear-attention (Triton; no CPU path) and its hybrid block spec TransformerEngine:

- :class:`LinearAttention`: the Gated DeltaNet token mixer, the engine's module
  (engines/linear_attention.py, HF parameter names) run over whole sequences from a zero
  state (its chunked delta rule, differentiable);
- :class:`GatedAttention`: full attention with the per-head output gate, q/k RMSNorm and
  partial RoPE, the engine's maths (engines/hybrid_model.py ``gated_qkv``), causal SDPA;
- :class:`OffsetRMSNorm`: the zero-centred RMSNorm (scale ``1 + weight``) of every layer.

Sequences are right-padded (engines/trainer/batching.py): a causal mixer's real tokens never
see the padding after them. Positions are ``0 .. L - 1`` (RoPE is computed here; the
GPTModel has no position embedding of its own). Tensor parallel is not built for these
layers (TP = 1; data and expert parallel are); the MTP head and the vision tower are not
trained (write_hf_checkpoint copies them from the source checkpoint).

HF names (``model.`` or, for the VL-wrapped checkpoints Qwen3.5 ships, ``model.language_model.``)
map one to one: ``layers.{i}.linear_attn.X`` / ``self_attn.X`` <-> ``decoder.layers.{i}.self_attention.X``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from engines.hybrid_model import gated_qkv
from engines.linear_attention import GatedDeltaNet
from engines.model import Attention, ModelConfig, _inv_freq

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


class LinearAttention(GatedDeltaNet):
    """A Gated DeltaNet layer as Megatron's ``self_attention``: [L, B, H] in, (output, None) out."""

    def __init__(self, config=None, submodules=None, layer_number: int = 1, model: ModelConfig = None, **_):
        super().__init__(model)
        _cast_params(self, config)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **_) -> tuple[torch.Tensor, None]:
        out = super().forward(hidden_states.transpose(0, 1))
        return out.transpose(0, 1).contiguous(), None


class GatedAttention(Attention):
    """Qwen3.5's gated full attention as Megatron's ``self_attention``: causal over each
    row, RoPE on the first ``rotary_dim`` dimensions at positions ``0 .. L - 1``."""

    def __init__(self, config=None, submodules=None, layer_number: int = 1, model: ModelConfig = None, **_):
        super().__init__(model)
        _cast_params(self, config)
        self.register_buffer("inv_freq", _inv_freq(model), persistent=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **_) -> tuple[torch.Tensor, None]:
        cfg = self.cfg
        x = hidden_states.transpose(0, 1)  # [B, L, H]
        b, length = x.shape[:2]
        freqs = torch.arange(length, device=x.device).float()[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        q, k, v, gate = gated_qkv(cfg, self, x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        groups = cfg.num_heads // cfg.num_kv_heads
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(b, length, cfg.num_heads * cfg.head_dim)
        return self.o_proj(o * torch.sigmoid(gate)).transpose(0, 1).contiguous(), None


def check_hybrid(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError when the trainer cannot build this hybrid config."""
    if tp != 1:
        raise ValueError(f"the Megatron trainer builds {cfg.arch} hybrid models without tensor parallel: use "
                         f"--tensor-model-parallel-size 1 (got {tp}); data and expert parallel work")
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
