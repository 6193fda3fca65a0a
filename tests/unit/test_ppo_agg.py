"""Loss aggregation modes: hand-computed cases, random cases against a loop reference, and DP=2
simulated in one process (global normalizers) against DP=1 on the same global batch."""

import dataclasses

import pytest
import torch

from hybridrl.algos.agg import AGG_MODES, AggNormalizers, agg_loss, compute_agg_normalizers


def reference_agg(loss, mask, mode):
    """Straightforward per-row loops over python floats (verl's single-batch formulas)."""
    rows = []
    for b in range(loss.shape[0]):
        toks = [float(loss[b, t]) for t in range(loss.shape[1]) if mask[b, t] > 0]
        rows.append(toks)
    n_tokens = sum(len(r) for r in rows)
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / n_tokens
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    return sum(sum(r) for r in rows) / loss.shape[1]


def test_agg_hand_case():
    loss = torch.tensor([[1.0, 2, 3, 5], [4, 0, 0, 1], [7, 8, 9, 1]])
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    # row sums 3, 4, 0; row counts 2, 1, 0 (the last row is excluded from the sequence means)
    expected = {
        "token-mean": 7 / 3,  # (3 + 4) / 3 tokens
        "seq-mean-token-sum": 3.5,  # (3 + 4) / 2 sequences
        "seq-mean-token-mean": 2.75,  # (3/2 + 4/1) / 2 sequences
        "seq-mean-token-sum-norm": 7 / 4,  # (3 + 4) / T=4
    }
    for mode, value in expected.items():
        assert agg_loss(loss, mask, mode).item() == pytest.approx(value, rel=1e-6), mode


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_agg_random_vs_reference(mode, seed):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=g) < 0.5).double()
    mask[0, 3] = 1.0
    mask[2] = 0.0  # one fully masked sequence
    assert agg_loss(loss, mask, mode).item() == pytest.approx(reference_agg(loss, mask, mode))


def test_agg_rejects_unknown_mode():
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        agg_loss(torch.ones(1, 2), torch.ones(1, 2), "token-sum")


def test_agg_empty_batch_is_zero_not_nan():
    for mode in AGG_MODES:
        out = agg_loss(torch.ones(2, 3), torch.zeros(2, 3), mode)
        assert out.item() == 0.0, mode


def test_compute_agg_normalizers_hand_case():
    m1 = torch.tensor([[1, 1, 0], [0, 0, 0]])
    m2 = torch.tensor([[1, 0, 0, 0, 1]])
    norm = compute_agg_normalizers([m1, m2])
    # tokens 2 + 2; non-empty sequences 1 + 1; widest padding 5; no DP group
    assert (norm.global_tokens, norm.global_seqs, norm.loss_scale_factor, norm.dp_size) == (
        4.0, 2.0, 5.0, 1,
    )
    assert compute_agg_normalizers(m1, loss_scale_factor=64).loss_scale_factor == 64


def _random_batch(seed, B=8, T=7):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    return loss, mask


def _shards(loss_leaf, mask, n_ranks, n_micro):
    """Rows dealt round-robin to ranks, each rank's rows split into micro-batches, each micro-batch
    trimmed to its own longest sequence (as a rank pads only to its local maximum)."""
    out = []
    for r in range(n_ranks):
        rows = torch.arange(r, loss_leaf.shape[0], n_ranks)
        micro = []
        for chunk in rows.chunk(n_micro):
            width = max(int(mask[chunk].sum(-1).max()), 1)
            micro.append((loss_leaf[chunk, :width], mask[chunk, :width]))
        out.append(micro)
    return out


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_agg_dp2_simulated_equals_dp1(mode, seed):
    loss, mask = _random_batch(seed)
    leaf1 = loss.clone().requires_grad_(True)
    ref = agg_loss(leaf1, mask, mode)
    ref.backward()

    leaf2 = loss.clone().requires_grad_(True)
    shards = _shards(leaf2, mask, n_ranks=2, n_micro=2)
    norm = compute_agg_normalizers([m for rank in shards for _, m in rank])
    # row 0 has full length T, so the widest micro-batch gives seq-mean-token-sum-norm's L = T
    norm = dataclasses.replace(norm, dp_size=2)
    shares = [sum(agg_loss(lo, m, mode, norm) for lo, m in rank) for rank in shards]
    # DDP: every rank backpropagates its share, gradients are averaged over the 2 ranks
    (sum(shares) / 2).backward()
    assert (sum(shares) / 2).item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(leaf2.grad, leaf1.grad, rtol=1e-12, atol=1e-14)

    summed = dataclasses.replace(norm, dp_size=1)  # plain sum of per-rank losses
    total = sum(agg_loss(lo, m, mode, summed) for rank in shards for lo, m in rank)
    assert total.item() == pytest.approx(ref.item(), rel=1e-12)


def test_agg_normalizers_validate():
    with pytest.raises(ValueError, match="dp_size"):
        AggNormalizers(dp_size=0)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        AggNormalizers(loss_scale_factor=0.0)
