"""The KL guard's post-update forward over a sample of the rows (trainer.kl_guard.row_fraction)."""

from types import SimpleNamespace as NS

import pytest
import torch

from hybridrl.rollout.batch import RolloutBatch
from hybridrl.trainer.guards import StepGuard, kl_rows


def _batch(n=8, r=3):
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(3, 50, (n, r), generator=g)
    mask = torch.ones(n, r, dtype=torch.long)
    mask[1, 2] = mask[5, 1:] = 0
    return RolloutBatch([[1, 2 + i] for i in range(n)], resp * mask, mask,
                        torch.zeros(n, r), [i // 4 for i in range(n)], [str(i) for i in range(n)],
                        ["x"] * n, [{"index": i} for i in range(n)], rows=list(range(10, 10 + n)))


def _guard(fraction):
    kl = NS(max_kl=1.0, mode="step", row_fraction=fraction)
    return StepGuard(NS(nonfinite="skip", kl_guard=kl), torch.device("cpu"), print)


def test_kl_rows_take_every_kth_row():
    assert kl_rows(8, 1.0) == list(range(8))
    assert kl_rows(8, 0.25) == [0, 4]
    assert kl_rows(3, 0.25) == [0]  # never empty
    assert kl_rows(9, 0.5) == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_final_kl_reads_only_the_sampled_rows_and_weights_tokens(fraction):
    rb = _batch()
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(8, 3, generator=g)
    new_all = -torch.rand(8, 3, generator=g)
    seen = []

    def logprobs(sub):
        seen.append(sub.rows)
        return new_all[[r - 10 for r in sub.rows]]  # the forward of exactly these rows

    out = _guard(fraction).final_kl(rb, old, rb.response_mask, logprobs, None)
    rows = kl_rows(8, fraction)
    assert seen == [[10 + i for i in rows]]
    m = rb.response_mask[rows].float()
    expect = float(((old[rows] - new_all[rows]) * m).sum() / m.sum())
    assert out["actor/ppo_kl_final"] == pytest.approx(expect, rel=1e-6)
    assert out["actor/ppo_kl_final_rows"] == len(rows)


def test_subset_keeps_every_field_of_its_rows():
    rb = _batch()
    sub = rb.subset([1, 5])
    assert sub.rows == [11, 15] and sub.prompt_ids == [[1, 3], [1, 7]]
    assert torch.equal(sub.response_mask, rb.response_mask[[1, 5]])
    assert sub.ground_truth == ["1", "5"] and sub.extra_info == [{"index": 1}, {"index": 5}]
    assert torch.equal(sub.microbatch([0, 1])["input_ids"], rb.microbatch([1, 5])["input_ids"])
    assert sub.loss_mask is None and sub.routed_experts is None
    rb.loss_mask = torch.arange(24).view(8, 3)
    rb.routed_experts = torch.arange(8 * 5 * 2 * 2).view(8, 5, 2, 2)
    sub = rb.subset([1, 5])
    assert torch.equal(sub.loss_mask, rb.loss_mask[[1, 5]])
    assert torch.equal(sub.routed_experts, rb.routed_experts[[1, 5]])
