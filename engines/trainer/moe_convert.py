"""Mixture-of-experts in the Megatron trainer: HF qwen3_moe <-> Megatron names of the
router and experts, and how experts split over expert-parallel (EP) ranks.

HF (per expert, what checkpoints hold)          Megatron (local spec, SequentialMLP)
``model.layers.{i}.mlp.gate.weight`` [E, H]     ``decoder.layers.{i}.mlp.router.weight``
``...mlp.experts.{e}.gate_proj.weight`` [I, H]  ``...mlp.experts.local_experts.{e}.linear_fc1.weight``
``...mlp.experts.{e}.up_proj.weight`` [I, H]       = [gate; up] rows, [2I, H]
``...mlp.experts.{e}.down_proj.weight`` [H, I]  ``...mlp.experts.local_experts.{e}.linear_fc2.weight``
``...mlp.shared_expert.gate_proj/up_proj``      ``...mlp.shared_experts.linear_fc1.weight`` ([gate; up])
``...mlp.shared_expert.down_proj.weight``       ``...mlp.shared_experts.linear_fc2.weight``
``...mlp.shared_expert_gate.weight`` [1, H]     ``...mlp.shared_experts.gate_weight`` (sigmoid gate)

Fused checkpoints (``mlp.experts.gate_up_proj`` [E, 2I, H] or [E, H, 2I], ``down_proj``
[E, H, I] or [E, I, H]) are split per expert first (:func:`per_expert`). The full Megatron
dict uses the *global* expert index ``e``; on EP rank ``r`` of ``ep`` the model holds experts
``r * E/ep .. (r+1) * E/ep - 1`` as local experts ``0 .. E/ep - 1`` (:func:`select_local_experts`,
:func:`gather_experts`). A shared expert (Qwen3.5) is replicated on every EP rank, as the
router is.
"""

from __future__ import annotations

import re

import torch

LOCAL = re.compile(r"^(.*\.mlp\.experts\.local_experts)\.(\d+)\.(.*)$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def check_moe(cfg, ep: int = 1) -> None:
    """Raise ValueError when the trainer cannot build this MoE config over ``ep`` ranks."""
    if cfg.num_experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {cfg.num_experts} experts")


def moe_layer_pattern(cfg) -> list[int]:
    """Megatron's ``moe_layer_freq`` as a list: 1 for a MoE layer, 0 for a dense one (HF's rule)."""
    return [int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]


def per_expert(cfg, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf`` with fused expert tensors split into the per-expert names (others untouched)."""
    out = {}
    for name, t in hf.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = t
            continue
        base, kind = m.group(1), m.group(2)
        i, h = cfg.moe_intermediate_size, cfg.hidden_size
        if kind == "gate_up_proj":
            t = t if tuple(t.shape[1:]) == (2 * i, h) else t.transpose(1, 2)
            for e in range(t.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = t[e, :i].contiguous()
                out[f"{base}.{e}.up_proj.weight"] = t[e, i:].contiguous()
        else:
            t = t if tuple(t.shape[1:]) == (h, i) else t.transpose(1, 2)
            for e in range(t.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
    return out


def hf_to_megatron_moe(cfg, hf: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router and experts, HF -> Megatron (global expert indices)."""
    h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    out = {m + "router.weight": hf[h + "gate.weight"]}
    for e in range(cfg.num_experts):
        x = f"{h}experts.{e}."
        out[f"{m}experts.local_experts.{e}.linear_fc1.weight"] = torch.cat(
            [hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]], dim=0)
        out[f"{m}experts.local_experts.{e}.linear_fc2.weight"] = hf[x + "down_proj.weight"]
    if cfg.shared_expert_intermediate_size:
        out[m + "shared_experts.linear_fc1.weight"] = torch.cat(
            [hf[h + "shared_expert.gate_proj.weight"], hf[h + "shared_expert.up_proj.weight"]], dim=0)
        out[m + "shared_experts.linear_fc2.weight"] = hf[h + "shared_expert.down_proj.weight"]
        out[m + "shared_experts.gate_weight"] = hf[h + "shared_expert_gate.weight"]
    return out


def megatron_to_hf_moe(cfg, sd: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router and experts, Megatron (global expert indices) -> HF per-expert names."""
    h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    out = {h + "gate.weight": sd[m + "router.weight"]}
    for e in range(cfg.num_experts):
        x = f"{h}experts.{e}."
        out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = sd[
            f"{m}experts.local_experts.{e}.linear_fc1.weight"].chunk(2, dim=0)
        out[x + "down_proj.weight"] = sd[f"{m}experts.local_experts.{e}.linear_fc2.weight"]
    if cfg.shared_expert_intermediate_size:
        out[h + "shared_expert.gate_proj.weight"], out[h + "shared_expert.up_proj.weight"] = sd[
            m + "shared_experts.linear_fc1.weight"].chunk(2, dim=0)
        out[h + "shared_expert.down_proj.weight"] = sd[m + "shared_experts.linear_fc2.weight"]
        out[h + "shared_expert_gate.weight"] = sd[m + "shared_experts.gate_weight"]
    return out


def select_local_experts(sd: dict[str, torch.Tensor], num_experts: int, ep: int, ep_rank: int) -> dict:
    """The full (global-index) Megatron dict -> EP rank ``ep_rank``'s: its experts only,
    renumbered from 0."""
    if ep == 1:
        return sd
    n = num_experts // ep
    out = {}
    for name, t in sd.items():
        m = LOCAL.match(name)
        if m is None:
            out[name] = t
            continue
        e = int(m.group(2))
        if ep_rank * n <= e < (ep_rank + 1) * n:
            out[f"{m.group(1)}.{e - ep_rank * n}.{m.group(3)}"] = t
    return out


def gather_experts(sd: dict[str, torch.Tensor], num_experts: int, ep_group) -> dict[str, torch.Tensor]:
    """This EP rank's dict (local expert indices) -> the full dict (global indices) on every
    rank: an all_gather over ``ep_group`` per expert tensor (a collective: every EP rank must
    call, with the same names, which holds since each rank has E/ep experts per MoE layer)."""
    import torch.distributed as dist

    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    if ep == 1:
        return sd
    n = num_experts // ep
    out = {}
    for name, t in sd.items():
        m = LOCAL.match(name)
        if m is None:
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(parts, t.contiguous(), group=ep_group)
        j = int(m.group(2))
        for r, p in enumerate(parts):
            out[f"{m.group(1)}.{r * n + j}.{m.group(3)}"] = p
    return out


def is_expert_param(name: str) -> bool:
    return LOCAL.match(name) is not None
