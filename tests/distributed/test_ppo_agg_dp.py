"""Loss aggregation at DP=2 (2 gloo ranks, 2 micro-batches each, per-micro-batch padding) equals
DP=1 on the same global batch, for every agg mode: the mean of the per-rank losses equals the
global loss, and the DDP-style mean of the per-rank gradients equals the global gradient.
The in-reward KL with a DP group takes the same adaptive-controller step on every rank as one
process holding the whole batch. One run_on_ranks call checks all of it."""

import pytest
import torch

from hybridrl.algos.agg import AGG_MODES, agg_loss, compute_agg_normalizers
from hybridrl.algos.kl_control import AdaptiveKLController, apply_kl_in_reward
from hybridrl.testing.dist import run_on_ranks

B, T, D = 10, 7, 3


def _global_batch():
    """Inputs x [B, T, D], response mask [B, T] (row 0 full length) and the initial weight [D]."""
    g = torch.Generator().manual_seed(123)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    w = torch.randn(D, generator=g, dtype=torch.float64)
    return x, mask, w


def _kl_inputs():
    """Scores, old and ref logprobs [B, T] for the in-reward KL."""
    g = torch.Generator().manual_seed(7)
    scores = torch.rand(B, T, generator=g, dtype=torch.float64)
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return scores, old, ref


def _kl_step(rows, mask, dp_group=None):
    """(rewards of ``rows``, metrics, controller value after the step)."""
    scores, old, ref = _kl_inputs()
    ctrl = AdaptiveKLController(0.1, target_kl=0.01, horizon=50)
    rewards, metrics = apply_kl_in_reward(scores[rows], old[rows], ref[rows], mask[rows], ctrl,
                                          "low_var_kl", dp_group=dp_group)
    return rewards.tolist(), metrics, ctrl.value


def _token_loss(w, x):
    return torch.nn.functional.softplus(x @ w)  # [b, t]


def _micro_batches(x, mask, dp_rank, dp_size, n_micro=2):
    """This rank's rows (round robin), split into micro-batches padded to their own width."""
    rows = torch.arange(dp_rank, x.shape[0], dp_size)
    out = []
    for chunk in rows.chunk(n_micro):
        width = max(int(mask[chunk].sum(-1).max()), 1)
        out.append((x[chunk, :width], mask[chunk, :width]))
    return out


def _rank_fn(rank, world_size):
    import torch.distributed as dist

    x, mask, w0 = _global_batch()
    micro = _micro_batches(x, mask, rank, world_size)
    norm = compute_agg_normalizers([m for _, m in micro], dp_group=dist.group.WORLD)
    results = {}
    for mode in AGG_MODES:
        w = w0.clone().requires_grad_(True)
        share = 0.0
        for xb, mb in micro:  # gradient accumulation over micro-batches
            loss = agg_loss(_token_loss(w, xb), mb, mode, norm)
            loss.backward()
            share += loss.item()
        grad = w.grad.clone()
        dist.all_reduce(grad)
        # DDP averages gradients over DP ranks; plain lists: tensors would travel as shared fds
        results[mode] = (share, (grad / world_size).tolist())
    kl = _kl_step(torch.arange(rank, B, world_size), mask, dp_group=dist.group.WORLD)
    return norm, results, kl


def test_agg_modes_and_kl_in_reward_dp2_equal_dp1():
    per_rank = run_on_ranks(_rank_fn, 2, timeout=120)
    x, mask, w0 = _global_batch()
    norm0, norm1 = per_rank[0][0], per_rank[1][0]
    rewards, metrics, beta = _kl_step(torch.arange(B), mask)
    for rank, (_, _, (rank_rewards, rank_metrics, rank_beta)) in enumerate(per_rank):
        assert rank_beta == pytest.approx(beta, rel=1e-14) and rank_beta != 0.1
        assert rank_metrics == pytest.approx(metrics, rel=1e-14)
        assert rank_rewards == rewards[rank::2]
    assert norm0 == norm1 and norm0.dp_size == 2
    assert norm0.global_tokens == mask.sum().item() and norm0.loss_scale_factor == T
    for mode in AGG_MODES:
        w = w0.clone().requires_grad_(True)
        ref = agg_loss(_token_loss(w, x), mask, mode)
        ref.backward()
        shares = [res[mode][0] for _, res, _ in per_rank]
        assert abs(sum(shares) / 2 - ref.item()) <= 1e-12 * max(1.0, abs(ref.item())), mode
        for _, res, _ in per_rank:
            grad = torch.tensor(res[mode][1], dtype=torch.float64)
            torch.testing.assert_close(grad, w.grad, rtol=1e-12, atol=1e-14)
