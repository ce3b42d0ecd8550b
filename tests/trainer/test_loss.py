"""Every GRPO loss branch against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from engines.trainer.loss import LossConfig, group_advantages, kl_penalty, policy_loss, token_weights

pytestmark = pytest.mark.unit


def t(*v):
    return torch.tensor([list(v)], dtype=torch.float64)


def test_group_advantages_divide_by_the_unbiased_std_as_the_original():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv = group_advantages(r, 2)
    # slime / Relax / verl: torch.std (n - 1): std of (1, 0) is 1/sqrt(2), so (1 - .5) / (0.7071 + 1e-6)
    assert torch.allclose(adv, torch.tensor([0.5 ** 0.5, -(0.5 ** 0.5), 0.0, 0.0]), atol=1e-5)
    assert torch.allclose(group_advantages(r, 2, normalize_std=False), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    assert torch.equal(group_advantages(r, 2, normalize=False), r)  # --disable-rewards-normalization
    eight = torch.tensor([1.0, 0, 0, 1, 1, 0, 1, 1])
    assert torch.allclose(group_advantages(eight, 8), (eight - eight.mean()) / (eight.std() + 1e-6))
    with pytest.raises(ValueError, match="complete groups"):
        group_advantages(torch.ones(5), 2)


def test_kl_types():
    d = torch.tensor([0.5, -20.0])
    ref = torch.zeros(2)
    assert torch.allclose(kl_penalty(d, ref, "k1"), d)
    assert torch.allclose(kl_penalty(d, ref, "k2"), torch.tensor([0.125, 200.0]))
    k3 = kl_penalty(d, ref, "k3")
    # the original clamps only low_var_kl (to [-10, 10]); k3 is left as it is
    assert k3[0].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert k3[1].item() == pytest.approx(math.exp(20.0) - 1 - 20.0)
    low = kl_penalty(d, ref, "low_var_kl")
    assert low[0].item() == k3[0].item() and low[1].item() == 10.0
    with pytest.raises(ValueError):
        kl_penalty(d, ref, "k4")


def test_clip_high_low_and_dual_clip():
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.28)
    one = torch.ones(1, 1)
    # positive advantage, ratio 1.5 -> clipped at 1.28
    loss, s = policy_loss(t(math.log(1.5)), t(0.0), torch.tensor([1.0]), one, cfg)
    assert loss.item() == pytest.approx(-1.28) and s["pg_clipfrac"] == 1.0
    # negative advantage, ratio 0.5 -> clipped at 0.8
    loss, s = policy_loss(t(math.log(0.5)), t(0.0), torch.tensor([-1.0]), one, cfg)
    assert loss.item() == pytest.approx(0.8) and s["pg_clipfrac"] == 1.0
    # inside the band: unclipped
    loss, s = policy_loss(t(math.log(1.1)), t(0.0), torch.tensor([2.0]), one, cfg)
    assert loss.item() == pytest.approx(-2.2) and s["pg_clipfrac"] == 0.0
    # dual clip: negative advantage, ratio 5 -> min(5, c=3)
    loss, _ = policy_loss(t(math.log(5.0)), t(0.0), torch.tensor([-1.0]), one, LossConfig(eps_clip_c=3.0))
    assert loss.item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="> 1"):
        policy_loss(t(0.0), t(0.0), torch.tensor([-1.0]), one, LossConfig(eps_clip_c=0.5))


def test_tis_kl_in_loss_and_logged_figures():
    one = torch.ones(1, 1)
    cfg = LossConfig(use_tis=True, tis_clip=2.0, tis_clip_low=0.0)
    loss, s = policy_loss(t(0.0), t(math.log(3.0)), torch.tensor([1.0]), one, cfg, rollout_logp=t(0.0))
    # ratio exp(0 - log 3) = 1/3 -> pg = max(-1/3, -0.8) = -1/3; TIS weight exp(log 3) = 3 clamped to 2
    assert loss.item() == pytest.approx(-2 / 3) and s["tis"] == 2.0 and s["tis_clipfrac"] == 1.0
    # KL(rollout || trainer) from rollout samples: r - 1 - log r with r = p_trainer / p_rollout = 3
    assert s["mismatch_kl"] == pytest.approx(3 - 1 - math.log(3))
    with pytest.raises(ValueError, match="rollout log-probs"):
        policy_loss(t(0.0), t(0.0), torch.tensor([1.0]), one, LossConfig(use_tis=True))
    # KL: logged when the reference is given; added only with a coefficient
    base, s0 = policy_loss(t(0.5), t(0.5), torch.tensor([1.0]), one, LossConfig(kl_type="k2"), ref_logp=t(0.0))
    with_kl, s1 = policy_loss(
        t(0.5), t(0.5), torch.tensor([1.0]), one, LossConfig(kl_type="k2", kl_coef=0.1), ref_logp=t(0.0)
    )
    assert s0["kl"] == pytest.approx(0.125) and with_kl.item() == pytest.approx(base.item() + 0.0125)
    # entropy bonus
    ent = torch.full((1, 1), 2.0)
    e0, _ = policy_loss(t(0.0), t(0.0), torch.tensor([1.0]), one, LossConfig(entropy_coef=0.5), entropy=ent)
    assert e0.item() == pytest.approx(-1.0 - 1.0)


def test_token_and_sample_aggregation():
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert (x * token_weights(mask, "token", 5)).sum().item() == pytest.approx((4 + 4) / 5)
    assert (x * token_weights(mask, "sample", 2)).sum().item() == pytest.approx((1 + 4) / 2)
    # a shard's weights use the whole step's denominator: two shards' sums add up to the step's mean
    assert (x[:1] * token_weights(mask[:1], "sample", 2)).sum() + (x[1:] * token_weights(mask[1:], "sample", 2)).sum() \
        == pytest.approx((1 + 4) / 2)
    with pytest.raises(ValueError):
        token_weights(mask, "batch", 2)
