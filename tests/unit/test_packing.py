"""Packed sequences, pure parts: the pack and its positions, the packed token-budget plan,
the rollout batch's packed micro-batch, and the varlen attention against per-sequence SDPA."""

import random
import warnings

import pytest
import torch
import torch.nn.functional as F

from hybridrl.data.batching import (
    computed_tokens,
    padded_tokens,
    plan_dp_micro_batches,
    plan_micro_batches,
)
from hybridrl.models import packing
from hybridrl.rollout.batch import RolloutBatch, gather_response


def test_pack_positions_and_tail():
    ids, cu = packing.pack_sequences([torch.tensor([5]), torch.tensor([1, 2, 3]),
                                      torch.tensor([7, 8])])
    assert ids.tolist() == [[5, 1, 2, 3, 7, 8]] and cu.tolist() == [0, 1, 4, 6]
    assert cu.dtype == torch.int32
    assert packing.positions(cu).tolist() == [0, 0, 1, 2, 0, 1]
    wide = packing.extend_tail(cu, 8)  # the sequence-parallel pad joins the last sequence
    assert wide.tolist() == [0, 1, 4, 8] and cu.tolist() == [0, 1, 4, 6]
    assert packing.positions(wide).tolist() == [0, 0, 1, 2, 0, 1, 2, 3]
    with pytest.raises(ValueError):
        packing.extend_tail(cu, 5)
    with pytest.raises(ValueError):
        packing.pack_sequences([torch.tensor([1]), torch.tensor([], dtype=torch.long)])


def test_attention_path_picks_the_cheapest_exact_way():
    cu = lambda lens: torch.tensor([0] + lens).cumsum(0).to(torch.int32)  # noqa: E731
    assert packing.attention_path(cu([64])) == "one"
    assert packing.attention_path(cu([83] * 16)) == "batch"  # uniform: the padded layout's cost
    assert packing.attention_path(cu([12] * 63 + [13])) == "batch"  # many short, little pad
    assert packing.attention_path(cu([30] * 15 + [400])) == "loop"  # a long tail: pad would cost
    assert packing.attention_path(cu([500, 500, 1])) == "loop"
    assert packing.use_mask(cu([1] * 60 + [200]))  # very many tiny + one long: the block mask
    assert not packing.use_mask(cu([83] * 16))


def test_batch_index_places_each_token_in_its_row():
    index = packing.batch_index(torch.tensor([0, 2, 3, 6]))  # lengths 2, 1, 3: rows of 3
    assert index.tolist() == [0, 1, 3, 6, 7, 8]
    assert packing.batch_index(torch.tensor([0, 4, 8])) is None  # uniform: a view, no index


def test_block_mask_is_causal_inside_each_sequence():
    mask = packing.block_causal_mask(torch.tensor([0, 2, 3, 5]))
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0],
                           [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expect)


@pytest.mark.parametrize("lens", [[1], [9], [1, 1, 1], [3, 1, 7, 2], [700, 1, 400]])
def test_varlen_attention_equals_each_sequence_alone(lens):
    """Each path (one, batch, block mask, per-sequence loop) equals SDPA on each sequence."""
    torch.manual_seed(0)
    s = sum(lens)
    q, k, v = torch.randn(1, 4, s, 8), torch.randn(1, 2, s, 8), torch.randn(1, 2, s, 8)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    bounds = cu.tolist()
    expect = torch.cat([F.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=0.3, enable_gqa=True)
        for a, b in zip(bounds[:-1], bounds[1:])], dim=2)
    paths = (None,) + packing.PATHS[len(lens) > 1:]  # the chosen one, then each ("one": n 1)
    for path in paths:
        got = packing.varlen_attention(q, k, v, cu, 0.3, path=path)
        torch.testing.assert_close(got, expect, atol=1e-6, rtol=0)
    if len(lens) > 1:
        with pytest.raises(ValueError, match="one sequence"):
            packing.varlen_attention(q, k, v, cu, 0.3, path="one")


@pytest.mark.parametrize("lens", [[5, 5, 5], [3, 1, 7, 2], [700, 1, 400]])
def test_varlen_attention_gradients_equal_on_every_path(lens):
    """The batch path's copies (index_copy / index_select) carry the gradient of real tokens
    only: q/k/v gradients equal the per-sequence loop's on every path."""
    torch.manual_seed(1)
    s = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    base = [torch.randn(1, h, s, 8) for h in (4, 2, 2)]
    weight = torch.randn(1, 4, s, 8)
    grads = {}
    for path in packing.PATHS[1:]:
        qkv = [t.clone().requires_grad_() for t in base]
        (packing.varlen_attention(*qkv, cu, 0.3, path=path) * weight).sum().backward()
        grads[path] = [t.grad for t in qkv]
    for path in ("batch", "mask"):
        for got, expect in zip(grads[path], grads["loop"]):
            torch.testing.assert_close(got, expect, atol=1e-5, rtol=0)


def test_packed_plan_counts_real_tokens():
    lens = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10]  # 200 real tokens
    padded = plan_micro_batches(lens, 120).micro_batches
    packed = plan_micro_batches(lens, 120, packed=True).micro_batches
    assert len(padded) == 2 and len(packed) == 2  # [100] + ten 10s (padded: 100 wide)
    assert max(padded_tokens(lens, p) for p in padded) <= 120
    assert all(computed_tokens(lens, p, True) <= 120 for p in packed)
    assert sorted(i for p in packed for i in p) == list(range(len(lens)))
    # a budget where padding wastes micro-batches: 16 rows of 30 and one of 120 (600 real)
    lens = [120] + [30] * 16
    assert len(plan_micro_batches(lens, 150).micro_batches) == 5
    assert len(plan_micro_batches(lens, 150, packed=True).micro_batches) == 4


def test_packed_plan_random_invariants():
    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.randint(1, 60) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(20, 200)
        want = rng.randint(1, 5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_micro_batches(lens, budget, want, packed=True)
        flat = sorted(i for p in plan.micro_batches for i in p)
        assert flat == list(range(len(lens)))
        assert plan.oversized == [i for i, n in enumerate(lens) if n > budget]
        for p in plan.micro_batches:
            assert computed_tokens(lens, p, True) <= budget or (len(p) == 1 and p[0] in plan.oversized)
        assert len(plan.micro_batches) >= min(want, len(lens))
        assert len(plan.micro_batches) >= -(-sum(min(n, budget) for n in lens) // budget)


def test_packed_dp_plans_have_one_count():
    lens = [random.Random(1).randint(1, 50) for _ in range(40)]
    plans = plan_dp_micro_batches(lens, 4, 90, packed=True)
    assert len({len(p.micro_batches) for p in plans}) == 1


def _batch():
    prompts = [[4], [5, 6, 7], [8, 9]]
    resp = torch.tensor([[0, 0, 0], [11, 12, 0], [13, 14, 15]])
    mask = (resp > 0).long()
    return RolloutBatch(prompts, resp, mask, torch.zeros(3, 3), [0, 1, 2], [None] * 3,
                        ["x"] * 3, [{}] * 3)


def test_packed_microbatch_reads_the_same_columns_as_the_padded_one():
    rb = _batch()
    pad = rb.microbatch([0, 1, 2])
    pk = rb.microbatch([0, 1, 2], packed=True)
    assert pk["input_ids"].tolist() == [[4, 5, 6, 7, 11, 12, 8, 9, 13, 14, 15]]
    assert pk["cu_seqlens"].tolist() == [0, 1, 6, 11]
    assert pk["seq_lens"].tolist() == pad["seq_lens"].tolist() == [1, 5, 5]
    # a per-token output equal to each token's id, in both layouts: the response columns that
    # the mask keeps read the same tokens (position t scores token t + 1: read ids shifted)
    nxt_pad = torch.roll(pad["input_ids"], -1, 1)
    nxt_pk = torch.roll(pk["input_ids"], -1, 1)
    m = pad["response_mask"].bool()
    assert torch.equal(gather_response(nxt_pad, pad["resp_index"])[m],
                       gather_response(nxt_pk, pk["resp_index"])[m])
    assert torch.equal(gather_response(nxt_pk, pk["resp_index"])[m], rb.response_ids[m])
    seq_of = torch.repeat_interleave(torch.arange(3), torch.tensor([1, 5, 5]))
    assert torch.equal(seq_of[pk["resp_index"]], torch.arange(3)[:, None].expand(3, 3))
    assert packing.token_counts([pad]) == (11, 15) and packing.token_counts([pk]) == (11, 11)
    assert packing.token_counts([pk], multiple=4) == (11, 12)


def test_rows_of_one_length_keep_the_padded_layout():
    """Nothing to unpad (rows 1 and 2 are both 5 tokens): packed=True gives the padded layout,
    the same tensors as packed=False, so uniform lengths cost what padding costs."""
    rb = _batch()
    pk, pad = rb.microbatch([1, 2], packed=True), rb.microbatch([1, 2])
    assert "cu_seqlens" not in pk and pk.keys() == pad.keys()
    assert all(torch.equal(pk[k], pad[k]) for k in pad)
    assert "cu_seqlens" in rb.microbatch([0, 1], packed=True)  # 1 and 5 tokens: a pack


def test_token_tally_reports_pad_fraction_and_starts_over():
    from hybridrl.trainer.microbatches import TokenTally, forward_parts

    rb = _batch()
    tally = TokenTally()
    assert tally.pop_metrics() == {}
    with tally.count([rb.microbatch([0, 1, 2])]):  # 11 real of 15 computed
        pass
    with tally.count([rb.microbatch([0, 1, 2], packed=True)], multiple=2):  # 11 of 12
        pass
    m = tally.pop_metrics()
    assert m["perf/pad_fraction"] == pytest.approx(1 - 22 / 27) and m["perf/tokens_per_s"] > 0
    assert tally.pop_metrics() == {}
    assert forward_parts([5, 1, 5], 2, False, 0, True) == [[0, 1], [2]]
    packed = forward_parts([5, 1, 5], 2, True, 6, True)  # <= 6 real tokens each: 2 packs
    assert len(packed) == 2 and sorted(i for p in packed for i in p) == [0, 1, 2]
    assert len(forward_parts([5, 1, 5], 2, True, 6, False)) == 3  # padded: 5 wide, one row each


def test_token_budget_plans_fill_the_pipeline_and_packs_share_host_state():
    from hybridrl.data.batching import plan_dp_micro_batches
    from hybridrl.models.packing import pack_cached, packed_seq_params

    lens = [30, 10, 20, 5, 25, 15, 8, 12]
    one = plan_dp_micro_batches(lens, 2, 1000, packed=True)  # everything fits in one pack a rank
    assert [len(p.micro_batches) for p in one] == [1, 1]
    four = plan_dp_micro_batches(lens, 2, 1000, packed=True, min_count=4)  # pp 4: 4 packs a rank
    assert [len(p.micro_batches) for p in four] == [4, 4]
    assert sorted(i for p in four for mb in p.micro_batches for i in mb) == list(range(8))
    capped = plan_dp_micro_batches(lens[:4], 2, 1000, packed=True, min_count=4)  # 2 rows a rank
    assert [len(p.micro_batches) for p in capped] == [2, 2]
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    params = packed_seq_params(cu, "cpu")
    assert params.max_seqlen_q == 5 and params.cu_seqlens_q.dtype == torch.int32
    host = pack_cached(params, "cu_host", lambda: None)  # set when built: no device read later
    assert host.device.type == "cpu" and host.tolist() == [0, 3, 4, 9]
    built = []
    first = pack_cached(params, "k", lambda: built.append(1) or "v")
    assert first == pack_cached(params, "k", lambda: built.append(1) or "w") == "v" and built == [1]
