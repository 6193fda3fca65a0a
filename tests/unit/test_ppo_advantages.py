"""Advantage estimators: GRPO groups (incl. a group of one), GAE + whitening against a loop
reference of the DESIGN.md recurrence, and the estimator registry."""

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from hybridrl.algos.advantages import ADVANTAGE_ESTIMATORS, compute_advantage
from hybridrl.registry import Registry


def outcome_rewards(scores, lengths, T):
    """[B, T] token rewards with each score on the last valid token, and the response mask."""
    B = len(scores)
    rewards = torch.zeros(B, T, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for b, (s, n) in enumerate(zip(scores, lengths)):
        mask[b, :n] = 1.0
        rewards[b, n - 1] = s
    return rewards, mask


def test_grpo_hand_case_with_group_of_one():
    rewards, mask = outcome_rewards([1.0, 0.0, 2.0, 1.0, 1.0, 1.0], [2, 3, 1, 3, 2, 1], T=3)
    index = np.array(["a", "a", "b", "c", "c", "c"], dtype=object)
    adv, ret = compute_advantage("grpo", rewards, mask, index=index)
    # group a: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    # group b (one member): mean 0, std 1 -> 2 / (1 + 1e-6); group c: std 0 -> 0
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected_b = [a, -a, 2 / (1 + 1e-6), 0.0, 0.0, 0.0]
    assert adv[:, 0].tolist() == pytest.approx(expected_b)  # token 0 is valid in every row
    assert adv.sum(-1).tolist() == pytest.approx([2 * a, -3 * a, 2 / (1 + 1e-6), 0, 0, 0])
    assert torch.equal(adv * (1 - mask), torch.zeros_like(adv))
    assert torch.equal(adv, ret)
    adv_nostd, _ = compute_advantage("grpo", rewards, mask, index=index,
                                     norm_adv_by_std_in_grpo=False)
    # Dr. GRPO: scores minus group mean (0 for the lone member of b)
    assert adv_nostd[:, 0].tolist() == pytest.approx([0.5, -0.5, 2.0, 0.0, 0.0, 0.0])


def grpo_reference(rewards, mask, index, eps, norm_by_std):
    scores = rewards.sum(-1)
    groups = defaultdict(list)
    for i, k in enumerate(index):
        groups[k].append(scores[i])
    out = torch.zeros_like(scores)
    for i, k in enumerate(index):
        members = torch.stack(groups[k])
        mean, std = (members.mean(), members.std()) if len(members) > 1 else (0.0, 1.0)
        out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return out[:, None] * mask


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_grpo_random_vs_reference(seed, norm_by_std):
    g = torch.Generator().manual_seed(seed)
    B, T = 24, 6
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.7).double()
    index = torch.randint(0, 9, (B,), generator=g)  # some groups of one, some absent
    expected = grpo_reference(rewards, mask, index.tolist(), 1e-6, norm_by_std)
    for idx in (index, [f"uid-{i}" for i in index.tolist()]):
        adv, _ = compute_advantage("grpo", rewards, mask, index=idx,
                                   norm_adv_by_std_in_grpo=norm_by_std)
        torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-12)


def whiten_reference(x, mask):
    """verl's masked whitening: means divide by (count + 1e-8), Bessel factor n/(n-1)."""
    sel, n = x[mask > 0], float((mask > 0).sum())
    mean = sel.sum() / (n + 1e-8)
    var = ((sel - mean) ** 2).sum() / (n + 1e-8) * n / (n - 1)
    return (x - mean) / np.sqrt(var + 1e-8)


def gae_reference(rewards, values, mask, gamma, lam):
    """DESIGN.md recurrence over python floats, then whitening over the masked entries."""
    B, T = rewards.shape
    adv = np.zeros((B, T))
    for b in range(B):
        nextv, last = 0.0, 0.0
        for t in reversed(range(T)):
            r, v, m = float(rewards[b, t]), float(values[b, t]), float(mask[b, t])
            g = r + gamma * nextv - v + gamma * lam * last
            nextv = v * m + (1 - m) * nextv
            last = g * m + (1 - m) * last
            adv[b, t] = last
    returns = adv + values.numpy()
    return whiten_reference(adv, mask.numpy()), returns


def test_gae_hand_case():
    rewards = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    adv, ret = compute_advantage("gae", rewards, mask, values=values, gamma=1.0, lam=1.0)
    # t=1: delta = 1 + 0 - 0.2 = 0.8 -> A = 0.8; t=0: delta = 0 + 0.2 - 0.5 = -0.3 -> A = 0.5
    # returns = A + V = [1.0, 1.0]; whitening: mean 0.65, unbiased var 0.045 -> -/+ 0.15/sqrt(.045)
    assert ret[0].tolist() == pytest.approx([1.0, 1.0])
    w = 0.15 / math.sqrt(0.045 + 1e-8)
    assert adv[0].tolist() == pytest.approx([-w, w])


@pytest.mark.parametrize("seed", range(3))
def test_gae_random_vs_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 11
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.7).double()  # holes = multi-turn observations
    gamma, lam = 0.9 + 0.1 * seed / 3, 0.95
    adv, ret = compute_advantage("gae", rewards, mask, values=values, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(ret.numpy(), ref_ret, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-11, atol=1e-12)


def test_estimators_reject_missing_inputs():
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", r, m)
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", r, m)
    with pytest.raises(ValueError, match="one entry per sequence"):
        compute_advantage("grpo", r, m, index=[0, 0, 1])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantage("ppo", r, m)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        compute_advantage("grpo", r, torch.ones(2, 4), index=[0, 1])


def test_user_estimator_gets_only_declared_inputs():
    seen = {}

    @ADVANTAGE_ESTIMATORS.register("test_mean_baseline", override=True)
    def mean_baseline(token_level_rewards, response_mask, gamma, scale=1.0):
        seen.update(gamma=gamma, scale=scale)
        s = token_level_rewards.sum(-1)
        adv = (s - s.mean())[:, None] * response_mask * scale
        return adv, adv

    r = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    adv, _ = compute_advantage("test_mean_baseline", r, torch.ones(2, 2), gamma=0.5,
                               index=[0, 1], scale=2.0)
    # scores 1 and 3, mean 2 -> (-1, +1) * 2 on both tokens
    assert adv.tolist() == [[-2.0, -2.0], [2.0, 2.0]]
    assert seen == {"gamma": 0.5, "scale": 2.0}


def test_registry_duplicates_and_override():
    reg = Registry("thing")
    reg.register("a")(len)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(abs)
    reg.register("a", override=True)(abs)
    assert reg.get("a") is abs and "a" in reg and reg.names() == ["a"]
    with pytest.raises(ValueError, match=r"unknown thing 'b'; registered: \['a'\]"):
        reg.get("b")
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("")


def rloo_reference(rewards, mask, index):
    scores = rewards.sum(-1)
    out = torch.zeros_like(scores)
    for i, k in enumerate(index):
        others = [scores[j] for j, kj in enumerate(index) if kj == k and j != i]
        out[i] = scores[i] - (sum(others) / len(others) if others else 0.0)
    return out[:, None] * mask


def test_rloo_hand_and_random():
    rewards, mask = outcome_rewards([1.0, 0.0, 2.0, 4.0], [2, 1, 3, 2], T=3)
    adv, _ = compute_advantage("rloo", rewards, mask, index=[7, 7, 7, 8])
    # group 7: 1 - (0+2)/2 = 0, 0 - (1+2)/2 = -1.5, 2 - (1+0)/2 = 1.5; group 8 alone keeps 4
    assert adv[:, 0].tolist() == pytest.approx([0.0, -1.5, 1.5, 4.0])
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(20, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(20, 5, generator=g) < 0.7).double()
    index = torch.randint(0, 7, (20,), generator=g).tolist()
    adv, ret = compute_advantage("rloo", rewards, mask, index=index)
    torch.testing.assert_close(adv, rloo_reference(rewards, mask, index), rtol=1e-10, atol=1e-12)
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("seed", range(2))
def test_reinforce_plus_plus_vs_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, gamma = 4, 6, 0.9
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.7).double()
    mask[0] = 1.0
    ref_ret = np.zeros((B, T))
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            running = float(rewards[b, t]) + gamma * running
            ref_ret[b, t] = running
            running *= float(mask[b, t])  # reset after a masked step
    ref_adv = whiten_reference(ref_ret, mask.numpy()) * mask.numpy()
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, mask, gamma=gamma)
    np.testing.assert_allclose(ret.numpy(), ref_ret, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-11, atol=1e-12)
    # hand case, one row, gamma 0.5, rewards [1, 2], all valid: G = [1 + 0.5*2, 2] = [2, 2]
    _, ret = compute_advantage("reinforce_plus_plus", torch.tensor([[1.0, 2.0]]),
                               torch.ones(1, 2), gamma=0.5)
    assert ret[0].tolist() == [2.0, 2.0]
