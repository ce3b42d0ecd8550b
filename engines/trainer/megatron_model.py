"""A Megatron-core ``GPTModel`` from an HF Qwen2/Qwen3/Llama/Qwen3-MoE/Qwen3.5 config (local
layer spec, no TransformerEngine), HF <-> Megatron weight conversion, and TP sharding / gathering.
Mixture-of-experts layers (router, experts, shared expert, expert parallelism):
engines/trainer/moe_convert.py; Qwen3.5's hybrid layers: engines/trainer/hybrid_layers.py.
A VL checkpoint's text model (``model.language_model.``) converts as ``model.`` and goes back
under its own prefix."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from engines.models.model import ModelConfig


def moe_options(cfg: ModelConfig, ep: int = 1, aux_loss_coeff: float | None = None) -> dict:
    """TransformerConfig's MoE fields for an HF qwen3_moe config. HF routes by a softmax over
    all experts, top-k, renormalised when ``norm_topk_prob``; Megatron's softmax over the
    top-k logits is exactly that renormalised softmax (pre_softmax False), and its softmax
    then top-k (pre_softmax True) is HF without renormalisation. The load-balancing loss is
    Switch's ("aux_loss"; HF's ``router_aux_loss_coef`` unless ``aux_loss_coeff`` is given);
    the allgather token dispatcher runs on gloo/CPU; experts are SequentialMLPs (no grouped GEMM)."""
    if not cfg.num_experts:
        return {}
    from engines.trainer.moe_convert import moe_layer_pattern

    coeff = cfg.router_aux_loss_coef if aux_loss_coeff is None else aux_loss_coeff
    shared = cfg.shared_expert_intermediate_size
    return dict(
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared),
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_pre_softmax=not cfg.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
        moe_aux_loss_coeff=coeff,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_layer_freq=moe_layer_pattern(cfg),
        expert_model_parallel_size=ep,
    )


def transformer_config(
    cfg: ModelConfig, tp: int = 1, dtype=torch.float32, ep: int = 1, aux_loss_coeff: float | None = None,
    recompute: dict | None = None,
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from engines.trainer import fusions

    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.intermediate_size or cfg.moe_intermediate_size,  # qwen3_5_moe: every MLP is MoE
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm and not cfg.hybrid,  # a hybrid's attention is ours (hybrid_layers.py)
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        **moe_options(cfg, ep, aux_loss_coeff),
        **fusions.install(),  # RoPE and SwiGLU in one pass each (engines/trainer/fusions.py)
        **{k: v for k, v in (recompute or {}).items() if v is not None},
    )


def build_gpt(cfg: ModelConfig, tp: int = 1, dtype=torch.float32, ep: int = 1, aux_loss_coeff: float | None = None,
              attention: str = "sdpa", recompute: dict | None = None):
    """The GPTModel of ``cfg``; MoE configs get MoE layers where HF has them (per-layer specs:
    ``decoder_sparse_step`` / ``mlp_only_layers`` layers stay dense), ``ep``: expert-parallel size.
    ``attention``: ``"sdpa"`` (torch's fused attention, memory linear in length:
    engines/trainer/attention.py) or ``"local"`` (Megatron's ``DotProductAttention``, which
    holds the ``[heads, S, S]`` scores; kept for comparison). ``recompute``: Megatron's
    ``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if cfg.rope_scaling is not None:
        raise ValueError(
            "the Megatron trainer does not support rope scaling (llama3-style) yet; the built-in "
            "engine does. Use a checkpoint without rope_scaling for training"
        )
    config = transformer_config(cfg, tp, dtype, ep, aux_loss_coeff, recompute)
    if cfg.num_experts:
        from engines.trainer.moe_convert import check_moe

        check_moe(cfg, ep)
    elif ep != 1:
        raise ValueError(f"expert parallel size {ep} needs a mixture-of-experts model; {cfg.arch} is dense")
    if cfg.hybrid:
        from engines.trainer.hybrid_layers import check_hybrid, hybrid_block_spec

        check_hybrid(cfg, tp)
        spec = hybrid_block_spec(config, cfg)
    elif cfg.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_norm)
    if attention == "sdpa":  # a hybrid's gated attention is SDPA already (hybrid_layers.py)
        from engines.trainer.attention import use_sdpa

        use_sdpa(spec)
    elif attention != "local":
        raise ValueError(f"attention must be 'sdpa' or 'local', not {attention!r}")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        position_embedding_type="none" if cfg.hybrid else "rope",  # a hybrid's attention turns its own
        rotary_base=int(cfg.rope_theta),
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        parallel_output=True,
    )
    from engines.trainer.fusions import fuse_norms

    fuse_norms(model)  # Megatron's local-spec RMSNorm in one kernel each way
    return model


def _qkv_rows(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v (rows = heads x head_dim) -> Megatron's per-group [q..., k, v] layout."""
    g, d = cfg.num_kv_heads, cfg.head_dim
    per = cfg.num_heads // g
    rest = q.shape[1:]
    q = q.reshape(g, per * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(g * (per + 2) * d, *rest)


def _split_qkv(cfg: ModelConfig, w: torch.Tensor, lazy: bool = False) -> tuple[torch.Tensor, ...]:
    """Megatron's per-group [q..., k, v] rows -> HF q, k, v. ``lazy``: views of ``w`` where
    the HF shape is not one (``weight_sync.shaped``) instead of copies."""
    from engines.weight_sync import shaped

    g, d = cfg.num_kv_heads, cfg.head_dim
    per = cfg.num_heads // g
    rest = w.shape[1:]
    w = w.reshape(g, (per + 2) * d, *rest)
    out = []
    for part, rows in zip(w.split([per * d, d, d], dim=1), (per * d, d, d)):
        shape = (g * rows, *rest)
        if not lazy:
            out.append(part.reshape(shape))
            continue
        # contiguous: a view of w (one KV group); else not expressible as one (a raised and
        # caught RuntimeError per tensor cost ~7 ms a push): the receiver reshapes it
        out.append(part.view(shape) if part.is_contiguous() else shaped(part, shape))
    return tuple(out)


def _renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(HF name, Megatron name) pairs that map one to one (no layout change); the fused
    q/k/v and gate/up tensors are handled by the two converters below."""
    pairs = [
        ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        ("model.norm.weight", "decoder.final_layernorm.weight"),
    ]
    if not cfg.tie_word_embeddings:
        pairs.append(("lm_head.weight", "output_layer.weight"))
    for i in range(cfg.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        if not cfg.is_moe_layer(i):
            pairs.append((h + "mlp.down_proj.weight", m + "mlp.linear_fc2.weight"))
        if cfg.hybrid:
            from engines.trainer.hybrid_layers import layer_renames

            pairs += layer_renames(cfg, i)
            continue
        pairs += [
            (h + "input_layernorm.weight", m + "input_layernorm.weight"),
            (h + "self_attn.o_proj.weight", m + "self_attention.linear_proj.weight"),
            (h + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight"),
        ]
        if cfg.qk_norm:
            pairs += [
                (h + "self_attn.q_norm.weight", m + "self_attention.q_layernorm.weight"),
                (h + "self_attn.k_norm.weight", m + "self_attention.k_layernorm.weight"),
            ]
    return pairs


def _qkv_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """The fused ``linear_qkv`` tensors of a layer (none in a hybrid: its attention keeps HF's q/k/v)."""
    return () if cfg.hybrid else ("weight", "bias") if cfg.qkv_bias else ("weight",)


def hf_to_megatron(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensor names -> the GPTModel state dict (TP=1; experts by global index: EP=1). A VL
    checkpoint's text model is read under ``cfg.text_prefix``; its vision tower and a Qwen3.5
    MTP head are not part of the model (engines/trainer/hybrid_layers.py ``NOT_TRAINED``)."""
    from engines.trainer.hybrid_layers import text_names
    from engines.trainer.moe_convert import hf_to_megatron_moe, per_expert

    hf, _ = text_names(hf)
    if cfg.num_experts:
        hf = per_expert(cfg, hf)
    out = {m: hf[h] for h, m in _renames(cfg)}
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        for kind in _qkv_kinds(cfg):
            out[m + f"self_attention.linear_qkv.{kind}"] = _qkv_rows(
                cfg, hf[a + f"q_proj.{kind}"], hf[a + f"k_proj.{kind}"], hf[a + f"v_proj.{kind}"]
            )
        if cfg.is_moe_layer(i):
            out.update(hf_to_megatron_moe(cfg, hf, i))
            continue
        mlp = f"model.layers.{i}.mlp."
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]], dim=0)
    return out


def megatron_to_hf(cfg: ModelConfig, sd: dict[str, torch.Tensor], lazy: bool = False) -> dict[str, torch.Tensor]:
    """The GPTModel state dict (TP=1, EP=1) -> HF tensor names (the inverse of :func:`hf_to_megatron`;
    experts under their per-expert checkpoint names; the text model under ``cfg.text_prefix``).
    ``lazy``: q/k/v as views of the fused weight (``weight_sync.shaped``; the in-place weight
    sync reads them), not copies."""
    from engines.trainer.moe_convert import megatron_to_hf_moe

    out = {h: sd[m] for h, m in _renames(cfg)}
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        for kind in _qkv_kinds(cfg):
            q, k, v = _split_qkv(cfg, sd[m + f"self_attention.linear_qkv.{kind}"], lazy)
            out[a + f"q_proj.{kind}"], out[a + f"k_proj.{kind}"], out[a + f"v_proj.{kind}"] = q, k, v
        if cfg.is_moe_layer(i):
            out.update(megatron_to_hf_moe(cfg, sd, i))
            continue
        mlp = f"model.layers.{i}.mlp."
        out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = sd[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
    if cfg.text_prefix == "model.":
        return out
    return {cfg.text_prefix + n[len("model."):] if n.startswith("model.") else n: t for n, t in out.items()}


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's mask convention: True where attention is *not* allowed."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


# Tensor-parallel layout of the GPTModel parameters (local spec): column-parallel weights
# split their rows, row-parallel ones their columns; the GLU fc1 holds [gate_r; up_r] per rank.
# Experts (``mlp.experts.local_experts.{j}.linear_fc1/2``) split like the dense MLP (expert
# tensor parallel size = TP); the router is replicated.
_COLUMN = (
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
)
_ROW = ("self_attention.linear_proj.weight", "linear_fc2.weight")
_GLU = "linear_fc1.weight"


def shard_for_rank(sd: dict[str, torch.Tensor], tp: int, rank: int, cfg: ModelConfig | None = None
                   ) -> dict[str, torch.Tensor]:
    """The TP=1 state dict -> this tensor-parallel rank's shard (a hybrid ``cfg``'s token
    mixers by heads: engines/trainer/hybrid_layers.py)."""
    from engines.trainer.hybrid_layers import is_mixer, shard_mixer

    if tp == 1:
        return sd
    out = {}
    for name, w in sd.items():
        if cfg is not None and cfg.hybrid and is_mixer(name):
            out[name] = shard_mixer(cfg, name, w, tp, rank)
        elif name.endswith(_GLU):
            gate, up = w.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], dim=0).clone()
        elif name.endswith(_COLUMN):
            if w.shape[0] % tp:
                raise ValueError(f"{name}: {w.shape[0]} rows do not split over TP={tp}")
            out[name] = w.chunk(tp, 0)[rank].clone()
        elif name.endswith(_ROW):
            out[name] = w.chunk(tp, 1)[rank].clone()
        else:
            out[name] = w
    return out


def _weights(model) -> list[tuple[str, torch.Tensor]]:
    """The state dict's tensors without Megatron's ``_extra_state`` entries: the parameters
    (a third of ``state_dict()``'s cost), unless this model's state dict holds anything else
    (checked on first use)."""
    if getattr(model, "_state_is_params", None) is None:
        keys = {k for k in model.state_dict() if not k.endswith("_extra_state")}
        model._state_is_params = keys == {n for n, _ in model.named_parameters()}
    if model._state_is_params:
        return list(model.named_parameters())
    return [(k, v) for k, v in model.state_dict().items() if not k.endswith("_extra_state")]


def gather_full(model, tp_group, copy: bool = True, ep_group=None, num_experts: int = 0,
                cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """Gather this rank's shards into the TP=1, EP=1 state dict (every rank gets it; experts
    by global index, gathered over ``ep_group``; a hybrid ``cfg``'s token mixers by heads).
    With ``copy=False`` unsharded tensors are the parameters themselves (read only)."""
    import torch.distributed as dist

    from engines.trainer.hybrid_layers import is_mixer, unshard_mixer

    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        from engines.trainer.moe_convert import gather_experts

        return gather_experts(gather_full(model, tp_group, copy, cfg=cfg), num_experts, ep_group)

    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    hybrid = cfg is not None and cfg.hybrid
    out = {}
    for name, p in _weights(model):
        mixer = hybrid and is_mixer(name)
        if tp == 1 or not (mixer or name.endswith(_COLUMN) or name.endswith(_ROW) or name.endswith(_GLU)):
            out[name] = p.detach().clone() if copy else p.detach()
            continue
        parts = [torch.empty_like(p) for _ in range(tp)]
        dist.all_gather(parts, p.detach().contiguous(), group=tp_group)
        if mixer:
            out[name] = unshard_mixer(cfg, name, parts)
        elif name.endswith(_GLU):
            gates = [x.chunk(2, 0)[0] for x in parts]
            ups = [x.chunk(2, 0)[1] for x in parts]
            out[name] = torch.cat(gates + ups, dim=0)
        elif name.endswith(_ROW):
            out[name] = torch.cat(parts, dim=1)
        else:
            out[name] = torch.cat(parts, dim=0)
    return out




@contextlib.contextmanager
def _hidden_out(layer):
    """While inside: the output layer passes its input through, so the model returns its final
    hidden states ``[b, s, h]``."""
    real = layer.forward
    layer.forward = lambda hidden_states, weight=None, runtime_gather_output=None: (hidden_states, None)
    try:
        yield real
    finally:
        del layer.forward


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    mask: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    padding_mask: torch.Tensor | None = None,
    entropy: str | None = None,
    packed_seq_params=None,
):
    """Per-token log-probs of ``targets`` under the model at ``temperature`` (the engines'
    definition: log-softmax of logits / T), vocab-parallel (no full-vocab gather across TP:
    each rank's partial sums are all-reduced). With ``entropy`` (``"logged"``:
    without gradient; ``"trained"``: with it): ``(log-probs, entropy of each position's
    distribution at T)``, from the same logits (no second forward). ``padding_mask`` (MoE
    models only; True on padding) keeps padding out of the routing statistics;
    ``packed_seq_params``: a packed micro-batch (one row of concatenated sequences).

    The logits are never held whole, nor in float32: the LM head and the log-softmax are
    fused (engines/kernels/token_logprobs.py), ``ROWS`` tokens at a time; the backward
    projects each chunk again."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    from engines.kernels.token_logprobs import lm_head_logprobs

    extra = {} if padding_mask is None else {"padding_mask": padding_mask}
    if packed_seq_params is not None:
        extra["packed_seq_params"] = packed_seq_params
    with _hidden_out(model.output_layer):
        hidden = model(input_ids, position_ids, mask, **extra)  # [b, s, h]
    weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
              else model.output_layer.weight)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:  # the column-parallel head's input: its gradient is summed over TP in backward
        hidden = copy_to_tensor_model_parallel_region(hidden)
    rows, length = targets.shape
    flat = hidden.reshape(rows * length, hidden.shape[-1])
    logp, ent = lm_head_logprobs(flat, weight, targets.reshape(-1), temperature,
                                 vocab_start=parallel_state.get_tensor_model_parallel_rank() * weight.shape[0],
                                 tp_group=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None)
    logp = logp.view(rows, length)
    if entropy is None:
        return logp
    ent = ent.view(rows, length)
    return logp, ent if entropy == "trained" and torch.is_grad_enabled() else ent.detach()
