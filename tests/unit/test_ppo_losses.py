"""Policy/value/entropy/KL loss terms: hand-computed cases, random cases against per-element
references (values and gradients), and the policy-loss registry."""

import math

import pytest
import torch

from hybridrl.algos.agg import AGG_MODES, agg_loss
from hybridrl.algos.losses import (
    POLICY_LOSSES,
    actor_loss,
    compute_policy_loss,
    kl_loss,
    value_loss,
    vanilla_policy_loss,
)


def test_policy_loss_hand_case():
    ratios = torch.tensor([[1.5, 4.0, 0.5]])
    logp = torch.log(ratios)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    loss, m = vanilla_policy_loss(old, logp, adv, torch.ones(1, 3), clip_ratio=0.2)
    # A=+1, r=1.5: max(-1.5, -1.2) = -1.2 (clipped)
    # A=-1, r=4:   max(4, 1.2) = 4, dual clip min(4, 3) = 3 (lower clip)
    # A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped), min(0.8, 3) = 0.8
    assert loss.item() == pytest.approx((-1.2 + 3 + 0.8) / 3, rel=1e-6)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(2 / 3, rel=1e-6)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 3, rel=1e-6)
    # ppo_kl = mean(old - logp) = -(log 1.5 + log 4 + log 0.5) / 3 = -log(3) / 3
    assert m["actor/ppo_kl"].item() == pytest.approx(-math.log(3) / 3, rel=1e-6)


def reference_policy_losses(old, logp, adv, lo, hi, c):
    """Per-element torch scalar ops, written branch by branch."""
    out = []
    for o, lp, a in zip(old.flatten(), logp.flatten(), adv.flatten()):
        r = torch.exp(torch.clamp(lp - o, -20.0, 20.0))
        unclipped, clipped = -a * r, -a * torch.clamp(r, 1 - lo, 1 + hi)
        loss = torch.maximum(unclipped, clipped)
        if a < 0:
            loss = torch.minimum(loss, -a * c)
        out.append(loss)
    return torch.stack(out).reshape(old.shape)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_random_vs_reference(mode):
    g = torch.Generator().manual_seed(3)
    B, T = 4, 6
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    logp0 = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp0[0, 0] = old[0, 0] + 30.0  # hits the +20 clamp of the log-ratio
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.8).double()
    lo, hi, c = 0.2, 0.28, 3.0

    logp = logp0.clone().requires_grad_(True)
    loss, m = vanilla_policy_loss(old, logp, adv, mask, clip_ratio_low=lo, clip_ratio_high=hi,
                                  clip_ratio_c=c, loss_agg_mode=mode)
    loss.backward()
    logp_ref = logp0.clone().requires_grad_(True)
    per_tok = reference_policy_losses(old, logp_ref, adv, lo, hi, c)
    ref = agg_loss(per_tok, mask, mode)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(logp.grad, logp_ref.grad, rtol=1e-12, atol=1e-14)

    sel = mask > 0
    ratio = torch.exp(torch.clamp(logp0 - old, -20, 20))
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
    assert m["actor/pg_clipfrac"].item() == pytest.approx((l2 > l1)[sel].double().mean().item())
    lower = (torch.maximum(l1, l2) > -adv * c) & (adv < 0)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(lower[sel].double().mean().item())
    ppo_kl = (old - logp0).clamp(-20, 20)[sel].mean().item()
    assert m["actor/ppo_kl"].item() == pytest.approx(ppo_kl)


def test_policy_loss_validation_and_registry():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        vanilla_policy_loss(x, x, x, torch.ones(1, 2), clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        compute_policy_loss("nope", x, x, x, x)
    assert "vanilla" in POLICY_LOSSES


def test_value_loss_hand_case():
    vpreds = torch.tensor([[1.0, 0.0]])
    values = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[2.0, -1.0]])
    loss, m = value_loss(vpreds, returns, values, torch.ones(1, 2), cliprange_value=0.5)
    # token 0: (1-2)^2 = 1, clipped v = 0.5 -> (0.5-2)^2 = 2.25 -> 2.25 (clipped is larger)
    # token 1: (0+1)^2 = 1, clipped v = 0 -> 1 -> 1 (not clipped)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1) / 2)
    assert m["critic/vf_clipfrac"].item() == pytest.approx(0.5)
    assert m["critic/vf_loss"].item() == pytest.approx(loss.item())


@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_random_vs_reference(mode):
    g = torch.Generator().manual_seed(5)
    B, T = 4, 7
    v0 = torch.randn(B, T, generator=g, dtype=torch.float64)
    old = v0 + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ret = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.7).double()
    eps = 0.3
    v = v0.clone().requires_grad_(True)
    loss, m = value_loss(v, ret, old, mask, cliprange_value=eps, loss_agg_mode=mode)
    loss.backward()
    v_ref = v0.clone().requires_grad_(True)
    per_tok = []
    for vp, o, r in zip(v_ref.flatten(), old.flatten(), ret.flatten()):
        vc = torch.clamp(vp, o - eps, o + eps)
        per_tok.append(torch.maximum((vp - r) ** 2, (vc - r) ** 2))
    ref = 0.5 * agg_loss(torch.stack(per_tok).reshape(B, T), mask, mode)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(v.grad, v_ref.grad, rtol=1e-12, atol=1e-14)
    clipped = (torch.clamp(v0, old - eps, old + eps) - ret) ** 2 > (v0 - ret) ** 2
    assert m["critic/vf_clipfrac"].item() == pytest.approx(clipped[mask > 0].double().mean().item())


def test_kl_loss_low_var_kl_vs_formula():
    g = torch.Generator().manual_seed(7)
    logp = torch.randn(3, 4, generator=g, dtype=torch.float64)
    ref = logp + torch.randn(3, 4, generator=g, dtype=torch.float64)
    ref[0, 0] = logp[0, 0] + 25.0  # exp(20) - 21 saturates at the +10 clamp
    mask = torch.ones(3, 4, dtype=torch.float64)
    mask[2, 1:] = 0
    loss, m = kl_loss(logp, ref, mask, kl_loss_type="low_var_kl")
    x = torch.clamp(ref - logp, -20, 20)
    k3 = torch.clamp(torch.exp(x) - x - 1, -10, 10)
    assert loss.item() == pytest.approx(k3[mask > 0].mean().item(), rel=1e-12)
    assert m["actor/kl_loss"].item() == loss.item()


def test_actor_loss_combines_terms_and_custom_policy_loss():
    g = torch.Generator().manual_seed(9)
    B, T = 3, 5
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mode = "seq-mean-token-mean"
    total, m = actor_loss(old, logp, adv, mask, entropy_BT=ent, entropy_coeff=0.01,
                          ref_log_prob=ref, use_kl_loss=True, kl_loss_type="k1",
                          kl_loss_coef=0.1, loss_agg_mode=mode, clip_ratio=0.1)
    pg, _ = vanilla_policy_loss(old, logp, adv, mask, clip_ratio=0.1, loss_agg_mode=mode)
    expected = pg - 0.01 * agg_loss(ent, mask, mode) + 0.1 * agg_loss(logp - ref, mask, mode)
    assert total.item() == pytest.approx(expected.item(), rel=1e-12)
    assert m["actor/pg_loss"].item() == pytest.approx(pg.item(), rel=1e-12)
    assert {"actor/entropy", "actor/kl_loss", "actor/kl_coef", "actor/ppo_kl"} <= set(m)

    @POLICY_LOSSES.register("test_reinforce", override=True)
    def reinforce(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, norm):
        return agg_loss(-advantages * log_prob, response_mask, loss_agg_mode, norm), {}

    total, _ = actor_loss(old, logp, adv, mask, policy_loss="test_reinforce",
                          loss_agg_mode=mode, clip_ratio=0.1)
    assert total.item() == pytest.approx(agg_loss(-adv * logp, mask, mode).item(), rel=1e-12)
    with pytest.raises(ValueError, match="ref_log_prob"):
        actor_loss(old, logp, adv, mask, use_kl_loss=True)
    with pytest.raises(ValueError, match="entropy_BT"):
        actor_loss(old, logp, adv, mask, entropy_coeff=0.1)
