"""HF checkpoint tensors into the built-in engine's parameters, by HF name: at load
(``load_weights``) and in weight updates (``place_weight``, engines/builtin/weights.py).

- A VL checkpoint (Qwen3-VL, Qwen3-VL-MoE) stores its text model under
  ``model.language_model.`` (served as ``model.``) and its vision tower under
  ``model.visual.`` (skipped: the engine serves text only).
- A Qwen3.5 checkpoint's multi-token-prediction head (``mtp.*``: a projection, norms and
  one extra layer, for speculative decoding) is skipped by name: the engine does not
  speculate, so it holds no MTP weights.
- MoE experts are held stacked (engines/models/moe.py) and addressed by the names checkpoints
  use: per expert (``...mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``: real
  Qwen3-MoE checkpoints and what transformers' ``save_pretrained`` writes for them) or fused
  (``...mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] as transformers 5
  holds them, or transposed, [E, H, 2I] and [E, I, H], as Qwen3-VL-MoE checkpoints store them;
  a square tensor is taken as it is, as transformers does).
- Every tensor is cut to this rank's tensor-parallel shard (``shard_tensor``).

The names a full update must cover are ``CausalLM.hf_names()`` (stacked experts listed per
expert); a fused tensor covers all of its experts' names.
"""

from __future__ import annotations

import torch

from engines.models.model import CausalLM, shard_tensor
from engines.models.moe import FUSED, PER_EXPERT, expert_names, expert_tp, local_experts

VL_TEXT_PREFIX = "model.language_model."
VL_VISION_PREFIX = "model.visual."
MTP_PREFIX = "mtp."  # Qwen3.5's multi-token-prediction head: not used (no speculative decoding)


def engine_name(name: str) -> str | None:
    """The engine's name of checkpoint tensor ``name``; None for one it does not load."""
    if name.startswith(VL_TEXT_PREFIX):
        return "model." + name[len(VL_TEXT_PREFIX):]
    if name.startswith((VL_VISION_PREFIX, MTP_PREFIX)):
        return None
    return name


def place_weight(model: CausalLM, params: dict, name: str, tensor: torch.Tensor, where: str,
                 copies: list | None = None) -> list[str]:
    """Copy the full HF tensor ``name`` (any device and dtype) into ``model``'s parameters
    (``params``: its ``named_parameters()``), this rank's shard of it. Returns the
    ``hf_names()`` it covered (none for a tensor the engine skips: a tied LM head, a vision
    tower, an MTP head). Raises KeyError for an unknown name, ValueError for a wrong shape (``where``
    leads the message). ``copies``: the copy is appended as ``(destination, source)`` for
    :func:`copy_all` instead of made now. A tensor marked with another HF shape
    (``weight_sync.shaped``: q/k/v read in place out of a trainer's fused weight) is copied
    into a view of its destination of its own shape where one exists, else reshaped."""
    cfg = model.cfg
    name = engine_name(name)
    if name is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
        return []
    per, fused = PER_EXPERT.match(name), FUSED.match(name)
    covered = [name]
    if per is not None:
        base, e, leaf = per.group(1), int(per.group(2)), per.group(3)
        p = params.get(f"{base}.{'down_proj' if leaf == 'down_proj' else 'gate_up_proj'}")
        if p is None or e >= cfg.num_experts:
            raise KeyError(f"{where}: unknown tensor {name!r} for a {cfg.arch} model")
        first, count = local_experts(cfg)
        if not first <= e < first + count:
            return covered  # an expert another expert-parallel group holds
        n = p.shape[2] if leaf == "down_proj" else p.shape[1] // 2
        e -= first
        dst = p[e] if leaf == "down_proj" else p[e, (leaf == "up_proj") * n:(leaf == "up_proj") * n + n]
    elif fused is not None and name in params:
        dst = params[name]
        split = expert_tp(cfg)[0]
        full = (cfg.num_experts, dst.shape[1] * split, dst.shape[2])
        if fused.group(2) == "down_proj":
            full = (full[0], full[1] // split, full[2] * split)
        if tuple(tensor.shape) != full and tuple(tensor.shape) == (full[0], full[2], full[1]):
            tensor = tensor.transpose(1, 2)  # a Qwen3-VL-MoE checkpoint's layout
        covered = expert_names(cfg, name)
    else:
        dst = params.get(name)
        if dst is None:
            raise KeyError(f"{where}: unknown tensor {name!r} for a {cfg.arch} model")
    marked = getattr(tensor, "hf_shape", None)
    if marked is not None and tuple(marked) != tuple(tensor.shape):
        if per is None and cfg.tp_size == 1 and tuple(dst.shape) == tuple(marked) and dst.is_contiguous():
            dst = dst.view(tensor.shape)  # the same elements in the same order: no reshaped copy
        else:
            tensor = tensor.reshape(marked)
    tensor = shard_tensor(cfg, name, tensor)
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"{where}: {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    if copies is not None:
        copies.append((dst, tensor))
    else:
        with torch.no_grad():
            dst.copy_(tensor)
    return covered


def copy_all(copies: list) -> None:
    """Make :func:`place_weight`'s deferred ``(destination, source)`` copies, those between
    tensors of one dtype on one device in a few batched launches (``torch._foreach_copy_``)."""
    groups: dict = {}
    for dst, src in copies:
        groups.setdefault((dst.device, dst.dtype, src.device, src.dtype), []).append((dst, src))
    with torch.no_grad():
        for (ddev, ddt, sdev, sdt), pairs in groups.items():
            if ddev == sdev and ddt == sdt:
                torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
            else:
                for dst, src in pairs:
                    dst.copy_(src)


def load_weights(model: CausalLM, path: str) -> None:
    """Load every ``*.safetensors`` file of an HF checkpoint directory (strict names: every
    tensor known, every parameter covered; a block-FP8 checkpoint's weights dequantized:
    engines/models/checkpoint.py)."""
    from engines.models.checkpoint import checkpoint_tensors

    params = dict(model.named_parameters())
    seen = set()
    for f, name, tensor in checkpoint_tensors(path):
        seen.update(place_weight(model, params, name, tensor, f"{path}/{f}"))
    missing = set(model.hf_names()) - seen
    if missing:
        raise KeyError(f"{path}: missing tensors {sorted(missing)[:5]}{'...' if len(missing) > 5 else ''}")
