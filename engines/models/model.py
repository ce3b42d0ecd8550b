"""The built-in engine's own forward pass for the Qwen2, Qwen3 (qk-norm) and Llama dense
families, Qwen3-MoE (mixture-of-experts MLPs: engines/models/moe.py) and the text model of Qwen3-VL
(-MoE), over a paged KV cache. Parameter names are the HF checkpoint names (stacked experts
aside: engines/models/weight_names.py maps checkpoint names onto the parameters, at load and in
weight updates).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engines.kernels.paged_attention import paged_decode_attention, triton_usable
from engines.models.linear_attention import GatedDeltaNet, check_shardable, hybrid_fields, shard_linear_tensor
from engines.models.moe import SparseMoE, check_moe_shardable, expert_names, shard_expert_tensor


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    max_position_embeddings: int
    eos_token_ids: list[int]
    tp_size: int = 1  # tensor-parallel ranks of an engine (shard_for); the model holds its rank's shard
    tp_rank: int = 0
    # mixture of experts (qwen3_moe and the VL-MoE text model); num_experts 0: every MLP dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple = ()
    router_aux_loss_coef: float = 0.0
    ep_size: int = 1  # expert-parallel groups of an engine's ranks (shard_for; engines/models/moe.py)
    ep_rank: int = 0
    # hybrid models (qwen3_5_moe; engines/models/linear_attention.py): each layer's token mixer,
    # "linear_attention" (Gated DeltaNet) or "full_attention"; () for a model of full attention only
    layer_types: tuple = ()
    linear_conv_kernel: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dimensions of q and k
    attn_output_gate: bool = False  # q_proj also gives a per-head gate: o * sigmoid(gate) before o_proj
    norm_offset: bool = False  # RMSNorm weights stored zero-centred: the scale is 1 + weight
    text_prefix: str = "model."  # the text model's name prefix in the checkpoint (VL ones: model.language_model.)

    @property
    def hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    def is_linear_layer(self, i: int) -> bool:
        return self.hybrid and self.layer_types[i] == "linear_attention"

    @property
    def kv_layers(self) -> int:
        """Layers with a KV cache (full attention): the first dimension of the cache tensors."""
        return sum(not self.is_linear_layer(i) for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is a mixture of experts (HF qwen3_moe's rule)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % max(1, self.decoder_sparse_step) == 0)

    def shard_for(self, tp_size: int, tp_rank: int, ep_size: int = 1) -> ModelConfig:
        """This config for rank ``tp_rank`` of an engine over ``tp_size`` GPUs (Megatron-style:
        attention heads, the MLP's intermediate size and an untied vocabulary split across
        ranks; KV heads split too, or replicated when there are fewer than ranks), a MoE
        model's experts in ``ep_size`` expert-parallel groups of ranks (engines/models/moe.py; a
        dense model ignores ``ep_size``, as SGLang does). Raises ValueError naming the
        dimension that does not divide."""
        import dataclasses

        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size} is not valid")
        if self.hybrid:
            check_shardable(self, tp_size)
        ep = ep_size if self.num_experts else 1
        if self.num_experts:
            check_moe_shardable(self, tp_size, ep)
        if tp_size > 1:
            for what, n in (("attention heads", self.num_heads), ("intermediate size", self.intermediate_size)):
                if n % tp_size:
                    raise ValueError(f"{what} ({n}) do not divide over {tp_size} tensor-parallel GPUs per engine")
            kv = self.num_kv_heads
            if kv % tp_size and tp_size % kv:
                raise ValueError(f"KV heads ({kv}) and {tp_size} tensor-parallel GPUs per engine: one must divide "
                                 "the other")
        return dataclasses.replace(self, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep,
                                   ep_rank=tp_rank // (tp_size // ep))

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def kv_head_start(self) -> int:
        """The first KV head of this rank (with fewer KV heads than ranks, several ranks hold the same one)."""
        return self.tp_rank * self.num_kv_heads // self.tp_size

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.tp_size

    @property
    def vocab_sharded(self) -> bool:
        """The LM head is split by vocabulary rows (a tied head stays whole, as the embedding)."""
        return self.tp_size > 1 and not self.tie_word_embeddings

    @property
    def local_vocab(self) -> int:
        return -(-self.vocab_size // self.tp_size) if self.vocab_sharded else self.vocab_size

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        """The config of an HF ``config.json`` (a VL checkpoint: its text model's, nested in
        ``text_config``). Raises ValueError naming an unsupported model type."""
        outer = d.get("model_type", "")
        prefix = "model."
        if outer in VL_TEXT_TYPES and "text_config" in d:
            prefix = "model.language_model."
            d = {**d["text_config"], "eos_token_id": d["text_config"].get("eos_token_id", d.get("eos_token_id")),
                 "tie_word_embeddings": d.get("tie_word_embeddings", d["text_config"].get("tie_word_embeddings"))}
        model_type = d.get("model_type", "")
        arch = ARCHS.get(model_type)
        if arch is None:
            raise ValueError(
                f"model_type {outer!r} is not supported by the built-in engine (qwen2, qwen3, llama, qwen3_moe, and "
                f"the text model of qwen3_vl, qwen3_vl_moe and qwen3_5_moe); use --engine sglang"
            )
        rope = d.get("rope_parameters") or {}
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "default"):
            raise ValueError(f"rope scaling {scaling!r} is not supported by the built-in engine")
        eos = d.get("eos_token_id")
        heads = d["num_attention_heads"]
        return cls(
            arch=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 0),  # qwen3_5_moe: every MLP is MoE, none given
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3" else None,
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            qk_norm=arch in ("qwen3", "qwen3_moe", "qwen3_5_moe"),
            qkv_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            **_moe_fields(d),
            **hybrid_fields(d),
            text_prefix=prefix,
        )

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf(json.load(f))


#: HF model types the built-in engine and trainer build, and the family each belongs to
ARCHS = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "qwen3_moe": "qwen3_moe",
         "qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe", "qwen3_5_moe_text": "qwen3_5_moe"}
#: VL checkpoints whose text model is served (their config nests it in ``text_config``)
VL_TEXT_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe")


def _moe_fields(d: dict) -> dict:
    """The mixture-of-experts fields of an HF config (none for a dense one). HF configs name
    the expert count ``num_experts`` (checkpoints) or ``num_local_experts`` (transformers 5)."""
    experts = d.get("num_experts", d.get("num_local_experts", 0)) or 0
    if not experts:
        return {}
    return {"num_experts": experts, "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["moe_intermediate_size"], "norm_topk_prob": bool(d.get("norm_topk_prob", False))
            or d.get("model_type") in ("qwen3_vl_moe_text", "qwen3_5_moe_text"),  # these routers always renormalise
            "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size", 0) or 0,
            "decoder_sparse_step": d.get("decoder_sparse_step", 1) or 1,
            "mlp_only_layers": tuple(d.get("mlp_only_layers") or ()),
            "router_aux_loss_coef": float(d.get("router_aux_loss_coef", 0.0) or 0.0)}


class RMSNorm(nn.Module):
    """``offset``: the weight is stored zero-centred (Qwen3.5), the scale is ``1 + weight``,
    applied in float32 before the cast back."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.offset:
            return F.rms_norm(x.float(), self.weight.shape, 1.0 + self.weight.float(), self.eps).to(dtype)
        if dtype == torch.float32:  # the same maths in one op (a CPU decode step is op-bound)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is not None:  # llama3 frequency-dependent scaling
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (old / wl - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        inv = torch.where((wl >= high_wl) & (wl <= low_wl), mid, scaled)
    return inv


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, kv, d = cfg.local_heads, cfg.local_kv_heads, cfg.head_dim
        # with an output gate, each head's query rows are followed by its gate rows
        self.q_proj = nn.Linear(cfg.hidden_size, h * d * (1 + cfg.attn_output_gate), bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_offset)
        self.cfg = cfg


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.local_intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.local_intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.local_intermediate, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        if cfg.is_linear_layer(i):
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.local_vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", _inv_freq(cfg), persistent=False)
        self.tp = None  # the engine's tensor-parallel group (engines/builtin/tp.py) when tp_size > 1

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel projection's partial output (in place)."""
        if self.tp is not None:
            self.tp.all_reduce(x)
        return x

    def hf_names(self) -> list[str]:
        """The checkpoint names of the parameters (stacked experts: each expert's)."""
        names = [e for n, _ in self.named_parameters() for e in (expert_names(self.cfg, n) or [n])]
        if self.cfg.tie_word_embeddings and "lm_head.weight" in names:
            names.remove("lm_head.weight")
        return names

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]  # broadcasts over heads
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _qkv(self, attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [..., H, D], k and v [..., KVH, D] of ``x`` [..., hidden], normed and rotated."""
        cfg = self.cfg
        lead = x.shape[:-1]
        q = attn.q_proj(x).view(*lead, cfg.local_heads, cfg.head_dim)
        k = attn.k_proj(x).view(*lead, cfg.local_kv_heads, cfg.head_dim)
        v = attn.v_proj(x).view(*lead, cfg.local_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._vocab(self.lm_head(self.model.norm(x)))

    def _vocab(self, logits: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """Logits over the whole vocabulary (a sharded head's parts gathered): float32, or in
        the head's dtype when ``keep_dtype`` (a fused decode step's: the sampler's kernel reads
        them as float32 without a [B, V] float32 copy written and read again)."""
        if self.cfg.vocab_sharded:
            logits = self.tp.all_gather_last(logits)[..., : self.cfg.vocab_size]
        return logits if keep_dtype else logits.float()

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: torch.Tensor,
        lens: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Whole prompts, none of them in the cache yet: ``input_ids`` [S, L] right-padded,
        ``lens`` [S] their lengths, ``slots`` [S, L] the cache slot (block * block_size +
        offset) each token's K/V is written to (padding: a scratch slot). Causal attention
        within each prompt; returns each prompt's last-token logits [S, vocab] (float32)."""
        if triton_usable(input_ids.device):  # the per-layer work in few kernels: engines/models/fused_decode.py
            from engines.models.fused_decode import prefill_fits, prefill_fused

            if prefill_fits(self):
                return prefill_fused(self, input_ids, lens, slots, k_cache, v_cache)
        cfg = self.cfg
        s_count, length = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(torch.arange(length, device=x.device), x.dtype)
        groups = cfg.local_heads // cfg.local_kv_heads
        flat_slots = slots.reshape(-1)
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            r = x
            q, k, v = self._qkv(attn, layer.input_layernorm(x), cos, sin)
            self._write_kv(k_cache[i], v_cache[i], flat_slots, k, v)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            if groups > 1:  # expanded so the fused (flash) SDPA kernels apply
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            # Right padding needs no mask: a real token never sees a later position.
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
            o = o.transpose(1, 2).reshape(s_count, length, cfg.local_heads * cfg.head_dim)
            x = r + self._reduce(attn.o_proj(o))
            x = x + self._reduce(layer.mlp(layer.post_attention_layernorm(x)))
        last = x[torch.arange(s_count, device=x.device), lens - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """One new token per sequence (``input_ids`` [B] at ``positions`` [B], K/V written
        to ``slots`` [B]) attending over its cached context through ``block_tables`` [B, W]
        (int32) and ``context_lens`` [B] (int32, including the new token). Static shapes
        and no host synchronisation, so CUDA graphs can capture it. Returns [B, vocab]
        logits: float32, or the model's dtype where Triton runs (the fused step's, read as
        float32 by the sampler's kernel; other consumers take ``.float()``)."""
        cfg = self.cfg
        x = self.model.embed_tokens(input_ids)
        scale = cfg.head_dim**-0.5
        if triton_usable(x.device):  # the per-layer work in few kernels: engines/models/fused_decode.py
            from engines.models.fused_decode import decode_fused

            return decode_fused(self, x, positions, slots, block_tables, context_lens, k_cache, v_cache)
        cos, sin = self._rope(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            r = x
            q, k, v = self._qkv(attn, layer.input_layernorm(x), cos, sin)
            self._write_kv(k_cache[i], v_cache[i], slots, k, v)
            o = paged_decode_attention(q, k_cache[i], v_cache[i], block_tables, context_lens, scale)
            x = r + self._reduce(attn.o_proj(o.reshape(-1, cfg.local_heads * cfg.head_dim)))
            x = x + self._reduce(layer.mlp(layer.post_attention_layernorm(x)))
        return self._logits(x)

    def _write_kv(
        self, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        kvh, d = self.cfg.local_kv_heads, self.cfg.head_dim
        kc.view(-1, kvh, d).index_copy_(0, slots, k.reshape(-1, kvh, d).to(kc.dtype))
        vc.view(-1, kvh, d).index_copy_(0, slots, v.reshape(-1, kvh, d).to(vc.dtype))

def shard_tensor(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full HF tensor ``name`` (``cfg.shard_for``): Q/K/V, gate and
    up projections by output rows, O and down projections by input columns, an untied LM
    head by vocabulary rows (zero rows past the vocabulary), everything else whole. A view
    where it can be; the tensor itself without tensor parallelism."""
    if cfg.tp_size == 1:
        return tensor
    if ".mlp.experts." in name or ".mlp.shared_expert." in name:  # engines/models/moe.py: by the experts' sizes
        return shard_expert_tensor(cfg, name, tensor)
    if ".linear_attn." in name:  # a hybrid model's Gated DeltaNet layer
        return shard_linear_tensor(cfg, name, tensor)
    r, d = cfg.tp_rank, cfg.head_dim
    leaf = name.rsplit(".", 2)[-2]  # "model.layers.0.self_attn.q_proj.weight" -> "q_proj"
    if leaf == "q_proj":  # gated attention (attn_output_gate): each head's query, then its gate
        return tensor.narrow(0, r * (rows := cfg.local_heads * d * (1 + cfg.attn_output_gate)), rows)
    if leaf in ("k_proj", "v_proj"):
        return tensor.narrow(0, cfg.kv_head_start * d, cfg.local_kv_heads * d)
    if leaf in ("gate_proj", "up_proj"):
        return tensor.narrow(0, r * cfg.local_intermediate, cfg.local_intermediate)
    if leaf == "o_proj":
        return tensor.narrow(1, r * cfg.local_heads * d, cfg.local_heads * d)
    if leaf == "down_proj":
        return tensor.narrow(1, r * cfg.local_intermediate, cfg.local_intermediate)
    if name == "lm_head.weight" and cfg.vocab_sharded:
        rows = tensor[r * cfg.local_vocab : (r + 1) * cfg.local_vocab]
        if rows.shape[0] < cfg.local_vocab:
            rows = torch.cat([rows, rows.new_zeros(cfg.local_vocab - rows.shape[0], *rows.shape[1:])])
        return rows
    return tensor
