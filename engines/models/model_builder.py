"""Complete HF checkpoints made locally, no downloads: config.json, model.safetensors, a
character-level tokenizer built with ``tokenizers`` and a Qwen-style chat template.

Used by tests, benchmarks, the tiny configs and the demo. Deterministic from the seed.
``relay make-model --arch qwen3 --size tiny --out DIR`` is the command-line form.
"""

from __future__ import annotations

import json
import os
import string

from engines.settings import settings as engines_settings

ARCHS = ("qwen3", "qwen2", "llama", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe")
#: mixture-of-experts architectures (their sizes add MOE_SIZES' fields)
MOE_ARCHS = ("qwen3_moe", "qwen3_vl_moe", "qwen3_5_moe")
#: VL architectures: the text model is served; a tiny vision tower is written (skipped at load)
VL_ARCHS = ("qwen3_vl", "qwen3_vl_moe")

#: Model shapes. "tiny"/"small" are for CPU tests; the others copy real architectures'
#: shapes (random weights) for benchmarks.
SIZES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    ),
    "small": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=128,
    ),
    "0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    "4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    "30b-a3b": dict(  # Qwen3-30B-A3B (MoE archs only)
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
    ),
}

#: The experts of each size of a MoE architecture (norm_topk_prob as Qwen3-30B-A3B)
MOE_SIZES: dict[str, dict] = {
    "tiny": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "small": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
    "30b-a3b": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}

#: Qwen3.5's hybrid text model (qwen3_5_moe): these replace/extend SIZES' and MOE_SIZES' fields.
#: "35b-a3b" is transformers' Qwen3_5MoeTextConfig defaults, documented there as the
#: Qwen3.5-35B-A3B configuration (rope_theta and max_position_embeddings: the published
#: config.json's values as we know them, unverified here). Random weights; `--layers` reduces depth.
HYBRID_SIZES: dict[str, dict] = {
    "tiny": dict(num_hidden_layers=4, full_attention_interval=2, head_dim=32, linear_conv_kernel_dim=4,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 shared_expert_intermediate_size=48, rope_theta=10000.0, mrope_section=[2, 1, 1]),
    "small": dict(num_hidden_layers=4, full_attention_interval=4, head_dim=32, linear_conv_kernel_dim=4,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                  shared_expert_intermediate_size=64, rope_theta=10000.0, mrope_section=[2, 1, 1]),
    "35b-a3b": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                    head_dim=256, vocab_size=248320, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512, full_attention_interval=4, linear_conv_kernel_dim=4,
                    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                    linear_value_head_dim=128, rope_theta=10000000.0, mrope_section=[11, 11, 10],
                    max_position_embeddings=262144),
}

#: The vision tower of a tiny VL checkpoint (never run by the engine: it only has to load in transformers)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                   temporal_patch_size=2, deepstack_visual_indexes=[0], num_position_embeddings=16)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_tokenizer():
    """A character-level tokenizer: special tokens first, then printable ASCII and newline,
    each character one token under its byte-level name (space is ``Ġ``, newline ``Ċ``, as in
    GPT-2/Qwen vocabularies). So the same ids come out when transformers loads it as
    ``Qwen3_5Tokenizer`` (which it forces for ``qwen3_5_moe`` checkpoints: a byte-level BPE
    built from this vocabulary, no merges) as through its own ``tokenizer.json``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    names = _byte_level_names()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [names[ord(c)] for c in chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # space -> Ġ, newline -> Ċ
        pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),  # then every character
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def _byte_level_names() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    names, extra = {}, 0
    for b in range(256):
        if b in printable:
            names[b] = chr(b)
        else:
            names[b] = chr(256 + extra)
            extra += 1
    return names


def hf_config(arch: str, size: str, **overrides):
    """The transformers config object of a model of this architecture and shape."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if size not in SIZES and size not in HYBRID_SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join([*SIZES, '35b-a3b'])}")
    if arch == "qwen3_5_moe":
        fits = list(HYBRID_SIZES)
    else:
        fits = [s for s in SIZES if s in ("tiny", "small") or (s in MOE_SIZES) == (arch in MOE_ARCHS)]
    if size not in fits:
        raise ValueError(f"size {size!r} is not made for {arch}; choose one of {', '.join(fits)}")
    import transformers

    if arch == "qwen3_5_moe":
        return _qwen35_config({**SIZES.get(size, {}), **MOE_SIZES.get(size, {}), **HYBRID_SIZES[size], **overrides})
    dims = dict(SIZES[size])
    if arch in MOE_ARCHS:
        dims.update(MOE_SIZES[size])
    dims.update(overrides)
    common = dict(
        max_position_embeddings=4096 if size in ("tiny", "small") else 40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
    )
    common.update({k: v for k, v in dims.items()})
    if arch == "qwen3":
        return transformers.Qwen3Config(**common)
    if arch in MOE_ARCHS or arch in VL_ARCHS:
        return _qwen3_family_config(arch, common)
    head_dim = common.pop("head_dim")
    if arch == "qwen2":
        if head_dim != common["hidden_size"] // common["num_attention_heads"]:
            common["hidden_size"] = head_dim * common["num_attention_heads"]
        return transformers.Qwen2Config(**common)
    common["tie_word_embeddings"] = False  # Llama checkpoints usually keep a separate head
    return transformers.LlamaConfig(head_dim=head_dim, **common)


def _qwen3_family_config(arch: str, common: dict):
    """Qwen3-MoE, or a Qwen3-VL(-MoE) whose text model has ``common``'s shape (an untied LM head, as
    Qwen3-30B-A3B and the Qwen3-VL-MoE checkpoints)."""
    import transformers

    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**common, "tie_word_embeddings": False})
    text = {k: v for k, v in common.items() if k != "tie_word_embeddings"}
    half = text["head_dim"] // 2  # text-only positions are equal in mrope's three sections: plain RoPE
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                               "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]}
    if arch == "qwen3_vl_moe":
        text.pop("norm_topk_prob", None)  # HF's VL-MoE router always renormalises
    vision = dict(TINY_VISION, out_hidden_size=text["hidden_size"])
    cls = transformers.Qwen3VLMoeConfig if arch == "qwen3_vl_moe" else transformers.Qwen3VLConfig
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=False)


def _qwen35_config(dims: dict):
    """A Qwen3.5-MoE checkpoint's config (``Qwen3_5MoeForConditionalGeneration``, as the real
    ones: the text model nested in ``text_config``, a tiny vision tower that the engine skips)."""
    import transformers

    text = {k: v for k, v in dims.items() if k not in ("intermediate_size", "norm_topk_prob", "rope_theta",
                                                        "mrope_section")}
    text.setdefault("max_position_embeddings", 4096)
    text.update(rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
                pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"))
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": dims["rope_theta"], "partial_rotary_factor": 0.25,
                               "mrope_interleaved": True, "mrope_section": dims["mrope_section"]}
    vision = dict(TINY_VISION, out_hidden_size=text["hidden_size"])
    for key in ("deepstack_visual_indexes",):  # Qwen3-VL's, not Qwen3.5's
        vision.pop(key)
    return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def make_model(
    arch: str = "qwen3",
    size: str = "tiny",
    out: str = "model",
    seed: int = 0,
    dtype: str = "float32",
    init_device: str = "cpu",
    **overrides,
) -> str:
    """Write a complete checkpoint directory; returns its path. Same seed (and
    ``init_device``), same bytes. ``init_device="cuda"`` initializes large shapes fast."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars in job logs
    cfg = hf_config(arch, size, **overrides)
    cls = {
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "llama": transformers.LlamaForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
        "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
    }[arch]
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    if size not in ("tiny", "small"):  # built in the target dtype (30B-A3B in float32 would not fit)
        torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(init_device):
            model = cls(cfg).to(getattr(torch, dtype))
    finally:
        torch.set_default_dtype(default)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if arch == "qwen3_5_moe":
        _add_mtp_weights(out, cfg.text_config, seed)
    build_tokenizer().save_pretrained(out)
    with open(os.path.join(out, "relay_model.json"), "w") as f:
        json.dump({"arch": arch, "size": size, "seed": seed, "dtype": dtype, "overrides": overrides}, f)
    return out


def _add_mtp_weights(out: str, text, seed: int) -> None:
    """Write a multi-token-prediction head into the checkpoint, named and shaped as Qwen3.5's
    ship it (``mtp.fc``, ``mtp.pre_fc_norm_*``, one full-attention MoE layer ``mtp.layers.0.*``,
    ``mtp.norm``; transformers builds no MTP module, so it is added here to the saved file)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    h, d, heads, kv = text.hidden_size, text.head_dim, text.num_attention_heads, text.num_key_value_heads
    e, i, si = text.num_experts, text.moe_intermediate_size, text.shared_expert_intermediate_size
    dt = tensors["lm_head.weight"].dtype
    shapes = {"fc.weight": (h, 2 * h), "pre_fc_norm_embedding.weight": (h,), "pre_fc_norm_hidden.weight": (h,),
              "norm.weight": (h,), "layers.0.input_layernorm.weight": (h,),
              "layers.0.post_attention_layernorm.weight": (h,),
              "layers.0.self_attn.q_proj.weight": (2 * heads * d, h), "layers.0.self_attn.k_proj.weight": (kv * d, h),
              "layers.0.self_attn.v_proj.weight": (kv * d, h), "layers.0.self_attn.o_proj.weight": (h, heads * d),
              "layers.0.self_attn.q_norm.weight": (d,), "layers.0.self_attn.k_norm.weight": (d,),
              "layers.0.mlp.gate.weight": (e, h), "layers.0.mlp.shared_expert_gate.weight": (1, h),
              "layers.0.mlp.shared_expert.gate_proj.weight": (si, h),
              "layers.0.mlp.shared_expert.up_proj.weight": (si, h),
              "layers.0.mlp.shared_expert.down_proj.weight": (h, si)}
    for x in range(e):
        shapes.update({f"layers.0.mlp.experts.{x}.gate_proj.weight": (i, h),
                       f"layers.0.mlp.experts.{x}.up_proj.weight": (i, h),
                       f"layers.0.mlp.experts.{x}.down_proj.weight": (h, i)})
    gen = torch.Generator().manual_seed(seed + 1)
    for name, shape in shapes.items():
        tensors[f"mtp.{name}"] = (torch.randn(shape, generator=gen) * 0.02).to(dt)
    save_file(tensors, path, metadata={"format": "pt"})


def builds_on_first_use(path: str) -> bool:
    """Whether :func:`ensure_model` builds a missing ``path``: it lies under the cache
    directory (``$RELAY_CACHE``, default ``.cache``, relative to the working directory)."""
    cache = os.path.abspath(engines_settings().cache)
    return os.path.abspath(path).startswith(cache + os.sep)


def first_use_arch(path: str) -> str:
    """The architecture :func:`ensure_model` builds at ``path``, by its folder's name: a name
    holding ``hybrid`` gets ``qwen3_5_moe`` (Qwen3.5), one holding ``vl-moe`` ``qwen3_vl_moe``, one
    holding ``moe`` ``qwen3_moe``, any other ``qwen3`` (``tiny-hybrid-judge``, ``tiny-moe-policy``,
    ``tiny-vl-moe-judge``, ``tiny-policy``)."""
    name = os.path.basename(os.path.normpath(path))
    if "hybrid" in name:
        return "qwen3_5_moe"
    return "qwen3_vl_moe" if "vl-moe" in name else "qwen3_moe" if "moe" in name else "qwen3"


def ensure_model(path: str, seed: int = 7) -> str:
    """``path`` if it holds a checkpoint; else, when ``path`` lies under the cache directory
    (``$RELAY_CACHE``, default ``.cache``), build a tiny random model there (the tiny configs'
    models: no download; its architecture from the folder's name, :func:`first_use_arch`) and
    return it. Anything else is a FileNotFoundError."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if not builds_on_first_use(path):
        cache = os.path.abspath(engines_settings().cache)
        raise FileNotFoundError(f"model {path!r} not found (only models under {cache} are built on first use)")
    tmp = path + f".tmp{os.getpid()}"
    make_model(first_use_arch(path), "tiny", tmp, seed=seed)
    if os.path.exists(os.path.join(path, "config.json")):
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # another process built it first
    else:
        os.replace(tmp, path)
    return path
