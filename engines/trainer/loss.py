"""GRPO: group-normalized advantages and the clipped policy loss with optional dual clip,
KL penalty (k1 / k2 / k3 / low_var_kl), truncated importance sampling (TIS) and entropy.

Shapes: per-token tensors are ``[B, T]`` with a 0/1 ``mask`` over response tokens. Log-probs
follow the engines' definition (log-softmax of logits / temperature; see
engines/interface.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6,
                     normalize: bool = True) -> torch.Tensor:
    """Per-sample advantages as the original (slime / Relax ``post_process_rewards``): reward
    minus its group's mean, divided by the group's unbiased (n - 1) std + ``eps`` unless
    ``normalize_std`` is off (``--disable-grpo-std-normalization``); the rewards themselves
    when ``normalize`` is off (``--disable-rewards-normalization``). A group of one sample gets
    reward minus itself: 0. Samples are in group order; groups must be complete."""
    if rewards.ndim != 1:
        raise ValueError("rewards must be a 1-D tensor, one per sample")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form complete groups of {group_size}")
    if not normalize:
        return rewards.float().clone()
    g = rewards.float().view(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        adv = adv / (g.std(dim=1, unbiased=True, keepdim=True) + eps)
    return adv.view(-1)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the sampling policy (``logp``) from the other (``ref_logp``),
    with ``d = logp - ref_logp``: k1 = d; k2 = d^2 / 2; k3 = exp(-d) - 1 + d; low_var_kl = k3
    clamped to [-10, 10] (as the original: only low_var_kl is clamped)."""
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind in ("k3", "low_var_kl"):
        k3 = torch.exp(-d) - 1 + d
        return torch.clamp(k3, -10.0, 10.0) if kind == "low_var_kl" else k3
    raise ValueError(f"unknown KL type {kind!r}; use k1, k2, k3 or low_var_kl")


def token_weights(mask: torch.Tensor, aggregation: str, denominator: float) -> torch.Tensor:
    """Each response token's weight in the step's loss (``[B, T]``, 0 off the response):
    ``sample``: 1 / (its sample's response tokens x ``denominator`` samples), so the weighted
    sum is the mean over samples of each sample's token-mean; ``token``: 1 / ``denominator``
    response tokens (the mean over tokens). ``denominator``: the whole step's count."""
    m = mask.float()
    if aggregation == "sample":
        return m / m.sum(-1, keepdim=True).clamp_min(1) / denominator
    if aggregation == "token":
        return m / denominator
    raise ValueError("loss aggregation must be 'sample' or 'token'")


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


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The GRPO loss, ``sum(weights * per-token loss)``, and its logged figures weighted the
    same way (:func:`token_weights`; as the original, the KL, entropy and every figure are
    aggregated like the policy loss). Per token: the clipped policy loss (dual clip for
    negative advantages), times the TIS weight ``clamp(exp(old - rollout))`` (no gradient),
    plus ``kl_coef`` x the KL to the reference, minus ``entropy_coef`` x the entropy.
    ``advantages`` is per sample ``[B]`` or per token ``[B, T]``; ``old_logp`` are the
    trainer's log-probs before the update; ``rollout_logp`` the engines' (TIS, mismatch_kl)."""
    adv = advantages[:, None].expand_as(logp) if advantages.ndim == 1 else advantages
    w = weights.to(logp.dtype)

    def agg(x: torch.Tensor) -> torch.Tensor:
        return (x * w).sum()

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
    if cfg.use_tis:
        if rollout_logp is None:
            raise ValueError("TIS needs the rollout log-probs")
        raw = torch.exp(old_logp - rollout_logp)
        tis = torch.clamp(raw, cfg.tis_clip_low, cfg.tis_clip)
        pg = pg * tis.detach()
        stats["tis"] = float(agg(tis))
        stats["tis_clipfrac"] = float(agg((tis != raw).float()))
    loss = agg(pg)
    stats["pg_loss"] = float(loss.detach())
    if ref_logp is not None:  # logged whenever given; in the loss only with a coefficient
        kl = agg(kl_penalty(logp, ref_logp, cfg.kl_type))
        stats["kl"] = float(kl.detach())
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    if entropy is not None:
        ent = agg(entropy)
        stats["entropy"] = float(ent.detach())
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ent
    stats["pg_clipfrac"] = float(agg(clipped))
    stats["ppo_kl"] = float(agg((old_logp - logp).detach()))
    if rollout_logp is not None:
        # KL(rollout || trainer), sampled from the rollout: k3 with d = rollout - trainer
        stats["mismatch_kl"] = float(agg(kl_penalty(rollout_logp, old_logp, "k3")))
        gap = (old_logp - rollout_logp).abs()
        stats["rollout_logprob_abs_diff"] = float(agg(gap))
        stats["rollout_logprob_abs_diff_max"] = float(gap[w > 0].max()) if bool((w > 0).any()) else 0.0
    stats["loss"] = float(loss.detach())
    return loss, stats
