"""Masked reductions and entropy: hand-computed cases and random cases against numpy."""

import math

import numpy as np
import pytest
import torch

from hybridrl.algos.masked import entropy_from_logits, masked_mean, masked_sum, masked_var


def test_masked_stats_hand_case():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]], dtype=torch.float64)
    # selected 1, 2, 5: sum 8, mean 8/3; squared deviations 25/9 + 4/9 + 49/9 = 78/9
    assert masked_sum(values, mask).item() == pytest.approx(8.0)
    assert masked_mean(values, mask).item() == pytest.approx(8 / 3)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(78 / 27)
    assert masked_var(values, mask).item() == pytest.approx(78 / 9 / 2)
    # per row: (1 + 2) / 2 and 5 / 1
    assert masked_mean(values, mask, dim=-1).tolist() == pytest.approx([1.5, 5.0])


def test_masked_ignores_nan_outside_mask():
    values = torch.tensor([[1.0, float("nan")], [float("inf"), 3.0]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert masked_sum(values, mask).item() == pytest.approx(4.0)
    assert masked_mean(values, mask).item() == pytest.approx(2.0)


@pytest.mark.parametrize("seed", range(4))
def test_masked_stats_random_vs_numpy(seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 7, generator=g) < 0.6).double()
    mask[0, 0] = mask[1, 1] = 1.0
    picked = values.numpy()[mask.numpy().astype(bool)]
    assert masked_mean(values, mask).item() == pytest.approx(picked.mean())
    assert masked_var(values, mask).item() == pytest.approx(picked.var(ddof=1))
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(picked.var())
    rows = [values[b][mask[b].bool()].numpy() for b in range(5)]
    ref = [r.mean() if len(r) else 0.0 for r in rows]
    assert masked_mean(values, mask, dim=-1).numpy() == pytest.approx(np.array(ref))


def test_masked_var_needs_two_entries():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(torch.ones(2, 2), torch.tensor([[1.0, 0.0], [0.0, 0.0]]))


def test_entropy_hand_and_random():
    # uniform over 4 outcomes: entropy log 4
    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 3
    p = torch.softmax(logits, dim=-1).numpy()
    ref = -(p * np.log(p)).sum(-1)
    assert entropy_from_logits(logits).numpy() == pytest.approx(ref)
