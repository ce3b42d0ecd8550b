"""GRPO: group-normalized advantages and the clipped policy loss with optional dual clip,
KL penalty (k1 / k2 / k3 / low_var_kl), truncated importance sampling (TIS) and entropy.

Shapes: per-token tensors are ``[B, T]`` with a 0/1 ``mask`` over response tokens. Log-probs
follow the engines' definition (log-softmax of logits / temperature; see
engines/interface.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample advantages: reward minus its group's mean, divided by the group's std + eps
    (unless ``normalize_std`` is off). Samples are in group order; groups must be complete."""
    if rewards.ndim != 1:
        raise ValueError("rewards must be a 1-D tensor, one per sample")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form complete groups of {group_size}")
    g = rewards.float().view(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (g.std(dim=1, unbiased=False, keepdim=True) + eps) if group_size > 1 else adv
    return adv.view(-1)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference, with ``d = logp - ref_logp``:
    k1 = d; k2 = d^2 / 2; k3 = low_var_kl = exp(-d) - 1 + d, clamped to [-10, 10]."""
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind in ("k3", "low_var_kl"):
        return torch.clamp(torch.exp(-d) - 1 + d, -10.0, 10.0)
    raise ValueError(f"unknown KL type {kind!r}; use k1, k2, k3 or low_var_kl")


def aggregate(x: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """``token``: mean over all response tokens; ``sample``: mean of per-sample means."""
    mask = mask.to(x.dtype)
    if level == "token":
        return (x * mask).sum() / mask.sum().clamp_min(1)
    if level == "sample":
        return ((x * mask).sum(-1) / mask.sum(-1).clamp_min(1)).mean()
    raise ValueError("loss aggregation must be 'token' or 'sample'")


@dataclass
class LossConfig:
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None  # dual clip (> 1)
    kl_coef: float = 0.0
    kl_type: str = "k1"
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    entropy_coef: float = 0.0
    aggregation: str = "token"


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The GRPO loss and its logged figures. ``advantages`` is per sample ``[B]`` or per token
    ``[B, T]``; ``old_logp`` are the trainer's log-probs before the update; ``rollout_logp``
    the engines' (for TIS and mismatch_kl)."""
    adv = advantages[:, None].expand_as(logp) if advantages.ndim == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    hi = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - cfg.eps_clip, 1 + hi)
    pg = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).float()
    if cfg.eps_clip_c is not None:
        if cfg.eps_clip_c <= 1:
            raise ValueError("eps_clip_c (dual clip) must be > 1")
        pg3 = -adv * cfg.eps_clip_c
        dual = torch.minimum(pg, pg3)
        pg = torch.where(adv < 0, dual, pg)
    stats: dict = {}
    m = mask.float()
    if cfg.use_tis:
        if rollout_logp is None:
            raise ValueError("TIS needs the rollout log-probs")
        raw = torch.exp(old_logp - rollout_logp)
        w = torch.clamp(raw, cfg.tis_clip_low, cfg.tis_clip)
        pg = pg * w.detach()
        stats["tis"] = float(aggregate(w, m))
        stats["tis_clipfrac"] = float(aggregate((w != raw).float(), m))
    loss = aggregate(pg, m, cfg.aggregation)
    if ref_logp is not None:  # logged whenever given; in the loss only with a coefficient
        kl = aggregate(kl_penalty(logp, ref_logp, cfg.kl_type), m, cfg.aggregation)
        stats["kl"] = float(kl.detach())
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    if entropy is not None:
        ent = aggregate(entropy, m, cfg.aggregation)
        stats["entropy"] = float(ent.detach())
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ent
    stats["pg_clipfrac"] = float(aggregate(clipped, m))
    stats["ppo_kl"] = float(aggregate((old_logp - logp).detach(), m))
    if rollout_logp is not None:
        stats["mismatch_kl"] = float(aggregate(kl_penalty(old_logp, rollout_logp, "k3"), m))
    stats["loss"] = float(loss.detach())
    return loss, stats
