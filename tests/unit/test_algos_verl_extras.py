"""GSPO, REINFORCE++-baseline, rollout-correction IS weights, Dr. GRPO and DAPO's overlong
penalty against verl's formulas on shared inputs (values and gradients).

verl cannot run here, so each ``verl_*`` function below is an independent reference written
from the semantics of verl's published code (``verl/trainer/ppo/core_algos.py``:
``compute_policy_loss_gspo``, ``compute_policy_loss_vanilla`` with ``rollout_is_weights``,
``compute_reinforce_plus_plus_baseline_outcome_advantage``, ``agg_loss``;
``verl/trainer/ppo/rollout_corr_helper.py``: truncated IS weights;
``verl/utils/torch_functional.py``: masked_mean / masked_var / masked_whiten;
``recipe/dapo`` / ``DAPORewardManager``: the overlong buffer). They use verl's own structure
(python loops, dicts of groups, per-row sums) rather than hybridrl's vectorized code, so a
shared mistake is unlikely. Shared inputs: a fixed-seed batch with ragged masks.
"""

from collections import defaultdict

import pytest
import torch

from hybridrl.algos.advantages import ADVANTAGE_ESTIMATORS, compute_advantage
from hybridrl.algos.losses import POLICY_LOSSES, actor_loss, compute_policy_loss
from hybridrl.algos.rollout_correction import rollout_is_metrics, rollout_is_weights
from hybridrl.rewards.penalties import overlong_penalty

# ---------------------------------------------------------------- verl references


def verl_masked_mean(x, m, axis=None):
    return (x * m).sum() / (m.sum() + 1e-8) if axis is None else (x * m).sum(axis) / (
        m.sum(axis) + 1e-8)


def verl_masked_whiten(x, m):
    mean = verl_masked_mean(x, m)
    centered = x - mean
    var = verl_masked_mean(centered ** 2, m)
    n = m.sum()
    var = var * n / (n - 1)  # unbiased
    return (x - mean) * torch.rsqrt(var + 1e-8)


def verl_agg_loss(loss_mat, mask, mode):
    if mode == "token-mean":
        return verl_masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-sum":
        return torch.mean((loss_mat * mask).sum(-1))
    if mode == "seq-mean-token-mean":
        return torch.mean((loss_mat * mask).sum(-1) / mask.sum(-1))
    if mode == "seq-mean-token-sum-norm":  # Dr. GRPO: divide by the constant (padded T)
        return torch.sum((loss_mat * mask).sum(-1)) / mask.shape[-1]
    raise AssertionError(mode)


def verl_gspo(old, logp, adv, mask, lo, hi, is_w=None):
    """verl aggregates GSPO seq-mean-token-mean whatever loss_agg_mode says."""
    neg_kl = logp - old
    seq_len = mask.sum(-1).clamp(min=1)
    neg_kl_seq = (neg_kl * mask).sum(-1) / seq_len
    log_s = logp - logp.detach() + neg_kl_seq.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    l1 = -adv * s
    l2 = -adv * torch.clamp(s, 1 - lo, 1 + hi)
    pg = torch.maximum(l1, l2)
    if is_w is not None:
        pg = pg * is_w
    return (verl_agg_loss(pg, mask, "seq-mean-token-mean"),
            verl_masked_mean(torch.gt(l2, l1).float(), mask))


def verl_vanilla(old, logp, adv, mask, lo, hi, c, mode, is_w=None):
    neg_kl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
    clip1 = torch.maximum(l1, l2)
    l3 = -adv * c
    clip2 = torch.min(l3, clip1)
    pg = torch.where(adv < 0, clip2, clip1)
    if is_w is not None:
        pg = pg * is_w
    return verl_agg_loss(pg, mask, mode)


def verl_rollout_is(old, rollout, mask, level, threshold):
    log_ratio = old - rollout
    if level == "token":
        w = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    else:
        log_sum = (log_ratio * mask).sum(-1, keepdim=True)
        w = torch.exp(torch.clamp(log_sum, -20.0, 20.0)).expand_as(old)
    w = w.clamp(max=threshold)
    return (w * mask).detach()


def verl_rpp_baseline(token_level_rewards, mask, index):
    T = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(-1).clone()
    id2score, id2mean = defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(group) == 1 else torch.mean(torch.stack(group))
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, T]) * mask
    return verl_masked_whiten(scores, mask) * mask


def verl_grpo(token_level_rewards, mask, index, norm_by_std, eps=1e-6):
    scores = token_level_rewards.sum(-1).clone()
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        if len(group) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx], id2std[idx] = torch.mean(torch.stack(group)), torch.std(torch.stack(group))
    for i in range(scores.shape[0]):
        d = scores[i] - id2mean[index[i]]
        scores[i] = d / (id2std[index[i]] + eps) if norm_by_std else d
    return scores.unsqueeze(-1) * mask


def verl_overlong(valid_len, max_resp_len, buffer_len, factor):
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_len - expected_len
    return min(-exceed_len / buffer_len * factor, 0)

# ---------------------------------------------------------------- shared inputs


@pytest.fixture()
def batch():
    g = torch.Generator().manual_seed(30)
    B, T = 6, 7
    lens = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(T) < lens[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 2
    logp = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_(True)
    engine = old + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    return old, logp, engine, adv, mask


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("lo,hi", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_matches_verl_value_and_grad(batch, mode, lo, hi):
    old, logp, _, adv, mask = batch
    ours, m = compute_policy_loss("gspo", old, logp, adv, mask, clip_ratio_low=lo,
                                  clip_ratio_high=hi, loss_agg_mode=mode)
    ref, ref_clipfrac = verl_gspo(old, logp, adv, mask, lo, hi)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(_grad(ours, logp), _grad(ref, logp), rtol=1e-6, atol=1e-7)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(ref_clipfrac.item(), abs=1e-7)
    assert m["actor/pg_clipfrac_lower"].item() == 0.0


def test_gspo_is_sequence_level(batch):
    """Within a sequence every token has the same ratio: the geometric mean of its token ratios;
    an unclipped token's gradient is -A·s_b·(agg weight), the same for every token of a row."""
    old, logp, _, adv, mask = batch
    wide = compute_policy_loss("gspo", old, logp, adv, mask, clip_ratio_low=10.0,
                               clip_ratio_high=10.0, loss_agg_mode="seq-mean-token-mean")[0]
    g = _grad(wide, logp)
    n = mask.sum(-1)
    s = torch.exp(((logp - old) * mask).sum(-1) / n).detach()
    expected = -adv[:, 0] * s / n / mask.shape[0]
    torch.testing.assert_close(g, expected[:, None] * mask, rtol=1e-6, atol=1e-8)
    assert "gspo" in POLICY_LOSSES.names()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [2.0, 1.2])
def test_rollout_is_weights_match_verl(batch, level, cap):
    old, _, engine, _, mask = batch
    w = rollout_is_weights(old, engine, mask, level, cap)
    torch.testing.assert_close(w, verl_rollout_is(old, engine, mask, level, cap))
    assert float(w.max()) <= cap * (1 + 1e-6) and not w.requires_grad
    m = rollout_is_metrics(old, engine, mask, level, cap)
    valid = mask.bool()
    assert m["rollout_corr/is_max"].item() == pytest.approx(float(w[valid].max()))
    assert m["rollout_corr/is_min"].item() == pytest.approx(float(w[valid].min()))
    assert m["rollout_corr/is_mean"].item() == pytest.approx(float(w[valid].mean()), rel=1e-6)
    raw = verl_rollout_is(old, engine, mask, level, float("inf"))
    assert m["rollout_corr/is_truncated_frac"].item() == pytest.approx(
        float((raw[valid] > cap).float().mean()), rel=1e-6)


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_actor_loss_with_rollout_is_matches_verl(batch, policy_loss, level):
    old, logp, engine, adv, mask = batch
    lo, hi = (0.2, 0.28) if policy_loss == "vanilla" else (3e-4, 4e-4)
    ours, metrics = actor_loss(old, logp, adv, mask, policy_loss=policy_loss,
                               loss_agg_mode="token-mean", clip_ratio_low=lo,
                               clip_ratio_high=hi, clip_ratio_c=3.0, rollout_log_prob=engine,
                               rollout_is=level, rollout_is_cap=2.0)
    w = verl_rollout_is(old, engine, mask, level, 2.0)
    if policy_loss == "vanilla":
        ref = verl_vanilla(old, logp, adv, mask, lo, hi, 3.0, "token-mean", w)
    else:
        ref = verl_gspo(old, logp, adv, mask, lo, hi, w)[0]
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(_grad(ours, logp), _grad(ref, logp), rtol=1e-6, atol=1e-7)
    assert "rollout_corr/is_mean" in metrics
    # the weights change the loss (this test can fail): without them it differs
    plain = actor_loss(old, logp, adv, mask, policy_loss=policy_loss, loss_agg_mode="token-mean",
                       clip_ratio_low=lo, clip_ratio_high=hi)[0]
    assert plain.item() != pytest.approx(ours.item(), rel=1e-4)


def test_rollout_is_refusals(batch):
    old, logp, _, adv, mask = batch
    with pytest.raises(ValueError, match="rollout_log_prob"):
        actor_loss(old, logp, adv, mask, rollout_is="token")
    with pytest.raises(ValueError, match="actor.rollout_is must be one of"):
        rollout_is_weights(old, old, mask, "geometric")


def test_reinforce_plus_plus_baseline_matches_verl(batch):
    _, _, _, _, mask = batch
    g = torch.Generator().manual_seed(7)
    scores = torch.randint(0, 2, (6,), generator=g).float() + 0.1 * torch.arange(6)
    rewards = torch.zeros_like(mask)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(6), last] = scores
    index = [0, 0, 1, 1, 1, 2]  # group 2 has one member: mean 0
    adv, ret = compute_advantage("reinforce_plus_plus_baseline", rewards, mask, index=index)
    ref = verl_rpp_baseline(rewards, mask, index)
    torch.testing.assert_close(adv, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret, adv)
    assert "reinforce_plus_plus_baseline" in ADVANTAGE_ESTIMATORS.names()


def test_dr_grpo_is_a_config_of_grpo_and_seq_mean_token_sum_norm(batch):
    """Dr. GRPO = norm_adv_by_std_in_grpo=False + loss_agg_mode=seq-mean-token-sum-norm."""
    old, logp, _, _, mask = batch
    rewards = torch.zeros_like(mask)
    rewards[:, 0] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    index = [0, 0, 0, 1, 1, 1]
    adv, _ = compute_advantage("grpo", rewards, mask, index=index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, verl_grpo(rewards, mask, index, False))
    normed, _ = compute_advantage("grpo", rewards, mask, index=index)
    torch.testing.assert_close(normed, verl_grpo(rewards, mask, index, True))
    ours = compute_policy_loss("vanilla", old, logp, adv, mask,
                               loss_agg_mode="seq-mean-token-sum-norm")[0]
    ref = verl_vanilla(old, logp, adv, mask, 0.2, 0.2, 3.0, "seq-mean-token-sum-norm")
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(_grad(ours, logp), _grad(ref, logp), rtol=1e-6, atol=1e-8)


def test_token_level_loss_is_token_mean(batch):
    """DAPO's token-level loss is verl's token-mean aggregation."""
    old, logp, _, adv, mask = batch
    ours = compute_policy_loss("vanilla", old, logp, adv, mask, clip_ratio_low=0.2,
                               clip_ratio_high=0.28, loss_agg_mode="token-mean")[0]
    ref = verl_vanilla(old, logp, adv, mask, 0.2, 0.28, 3.0, "token-mean")
    torch.testing.assert_close(_grad(ours, logp), _grad(ref, logp), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("n", [0, 10, 12, 13, 16, 20])
def test_overlong_penalty_matches_verl(n):
    assert overlong_penalty(n, 20, 8, 1.5) == pytest.approx(verl_overlong(n, 20, 8, 1.5))
    assert overlong_penalty(n, 20, 8, 1.5) <= 0.0


def test_overlong_penalty_shape():
    assert overlong_penalty(12, 20, 8) == 0.0  # at the buffer's start
    assert overlong_penalty(16, 20, 8) == -0.5
    assert overlong_penalty(20, 20, 8) == -1.0
    with pytest.raises(ValueError, match="reward.overlong_buffer"):
        overlong_penalty(5, 20, 21)
