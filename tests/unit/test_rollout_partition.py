"""hybridrl.rollout.partition (pure parts) and hybridrl.rewards.distributed without a group.

Checked: every row lands on exactly one DP rank, each mini-batch chunk is spread over all ranks
with equal unit counts and balanced tokens, prompt groups stay whole when asked, a too-small
chunk is refused; transfers reach every rank of the owning replica from the generating rank;
pack/unpack round-trips ids and fp32 log-probs exactly without padding; the byte model gives
the rank's share (1/dp) for the partitioned path; row scoring: the same scores and metrics as
``RewardScorer.score_batch``, a timeout and an exception become one line naming the function,
the row and its data_source, and a process pool gives the same scores.
"""

from __future__ import annotations

import time

import pytest
import torch

from hybridrl.rewards.distributed import RowItem, score_rows, summarize
from hybridrl.rewards.scoring import RewardScorer
from hybridrl.rollout.base import GenerationOutput
from hybridrl.rollout.partition import (
    check_prefix_mask,
    exchange_rollouts,
    plan_rollout_partition,
    plan_transfers,
    rollout_bytes_model,
)


def test_partition_spreads_each_chunk_and_keeps_groups():
    lens = [5, 90, 7, 60, 33, 2, 41, 18, 9, 70, 12, 25, 3, 80, 44, 16]
    for dp, chunk, group in ((2, 8, 2), (4, 8, 2), (2, 16, 1), (4, 16, 4), (1, 4, 2)):
        parts = plan_rollout_partition(lens, dp, chunk, group)
        assert sorted(r for p in parts for r in p) == list(range(16))
        for start in range(0, 16, chunk):
            per_rank = [[r for r in p if start <= r < start + chunk] for p in parts]
            assert {len(p) for p in per_rank} == {chunk // dp}  # equal counts in every chunk
            for p in per_rank:  # whole groups only
                assert all(r - r % group + k in p for r in p for k in range(group))
    # token balance: no worse than the contiguous split, strictly better here
    parts = plan_rollout_partition(lens, 2, 16, 1)
    spread = abs(sum(lens[r] for r in parts[0]) - sum(lens[r] for r in parts[1]))
    assert spread < abs(sum(lens[:8]) - sum(lens[8:]))
    with pytest.raises(ValueError, match="raise ppo_mini_batch_size"):
        plan_rollout_partition(lens, 4, 4, 2)


def test_transfers_reach_every_rank_of_the_replica():
    owner = [0, 0, 2, 2]  # two gen replicas with sources 0 and 2
    parts = [[0, 3], [1, 2]]
    replicas = [[0, 1], [2, 3]]  # dp 0 = ranks 0, 1 (tp 2); dp 1 = ranks 2, 3
    t = plan_transfers(owner, parts, replicas)
    assert t == {(0, 0): [0], (0, 1): [0], (2, 0): [3], (2, 1): [3], (0, 2): [1], (0, 3): [1],
                 (2, 2): [2], (2, 3): [2]}


def test_local_exchange_round_trips_without_padding():
    ids = torch.tensor([[5, 6, 7], [8, 0, 0], [9, 10, 0]])
    mask = (ids > 0).long()
    logp = torch.tensor([[-0.1, -0.2, -0.3], [-1.5, 0, 0], [-2.25, -1e-7, 0]])
    out = GenerationOutput(ids, mask, logp)
    lens = check_prefix_mask(out)
    assert lens == [3, 1, 2]
    transfers = {(0, 0): [0, 2]}
    got, stats = exchange_rollouts(0, transfers, [0, 2], [0, 1, 2], out, lens, -1, "cpu")
    assert torch.equal(got.response_ids, torch.tensor([[5, 6, 7], [9, 10, -1]]))
    assert torch.equal(got.response_mask, mask[[0, 2]])
    assert torch.equal(got.logprobs, logp[[0, 2]])  # fp32 bits travel exactly
    assert stats.bytes_in == stats.bytes_out == 0  # a local copy
    with pytest.raises(ValueError, match="1 on the first tokens"):
        check_prefix_mask(GenerationOutput(ids, torch.tensor([[1, 0, 1]] * 3), logp))


def test_byte_model_partitioned_is_the_share():
    for dp in (2, 4, 8):
        m = rollout_bytes_model(8192, 1000, 2048, world=dp * 4, dp=dp, gen_tp=4)
        assert m["useful"] == pytest.approx(8192 / dp * 1000 * 8)
        assert m["partitioned"] == pytest.approx(m["useful"] + 4 * 8192)
        assert m["allgather"] > 3 * 2048 * 8192 * 8 * 0.99  # every row of the batch, float64


def _items():
    texts = ["#### 3", "#### 4", "nothing", "#### 7"]
    return [RowItem(10 + i, t, [1] * (i + 1), gt, src, {"index": 100 + i})
            for i, (t, gt, src) in enumerate(zip(texts, ["3", "5", "1", "7"],
                                                  ["gsm8k", "gsm8k", "gsm8k", "other"]))]


def _scorer(**kw):
    def other(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "bonus": 2.0}

    scorer = RewardScorer(length_penalty=True, **kw)
    scorer.registry.register("other", other, override=True)
    return scorer


def test_row_scores_and_metrics_equal_score_batch():
    scorer, items = _scorer(), _items()
    rows = score_rows(scorer, items, timeout_s=5.0, max_response_length=4)
    want, want_metrics = scorer.score_batch([i.text for i in items],
                                            [i.ground_truth for i in items],
                                            [i.data_source for i in items],
                                            [i.extra_info for i in items],
                                            [i.ids for i in items], 4)
    assert [r.row for r in rows] == [10, 11, 12, 13]
    assert torch.tensor([r.final for r in rows], dtype=torch.float32).tolist() == want.tolist()
    timed = {"timing_s/reward_row_max", "timing_s/reward_row_mean"}  # seconds: per call
    got = summarize(rows)
    assert timed <= got.keys() and timed <= want_metrics.keys()
    assert {k: v for k, v in got.items() if k not in timed} == pytest.approx(
        {k: v for k, v in want_metrics.items() if k not in timed})


def test_timeout_and_exception_name_function_source_and_row():
    def slow(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(30)  # in a daemon thread: left behind, as a hung reward function is
        return 1.0

    def broken(data_source, solution_str, ground_truth, extra_info=None):
        raise KeyError("w")

    start = time.perf_counter()
    line = score_rows(RewardScorer(custom_fn=slow), _items()[:2], timeout_s=0.2)
    assert time.perf_counter() - start < 10  # ~0.2 s: the timeout, not the 30 s call
    assert line == ("reward function 'slow' no result within 0.2 s (reward.timeout_s) on row 10 "
                    "(data_source 'gsm8k', index 100)")
    line = score_rows(RewardScorer(custom_fn=broken), _items()[1:], timeout_s=0)
    assert line == ("reward function 'broken' raised KeyError: 'w' on row 11 "
                    "(data_source 'gsm8k', index 101)")


def test_process_pool_scores_alike():
    import dataclasses
    import json
    import multiprocessing as mp

    from hybridrl.config.algorithm import RewardConfig

    cfg = RewardConfig(num_workers=2, use_length_penalty=True)
    items = [i for i in _items() if i.data_source == "gsm8k"]  # registered in a fresh process
    scorer = _scorer()
    with mp.get_context("forkserver").Pool(2) as pool:
        pooled = score_rows(scorer, items, 5.0, pool, json.dumps(dataclasses.asdict(cfg)), 4)
    local = score_rows(scorer, items, 5.0, None, "", 4)
    assert [(r.row, r.final) for r in pooled] == [(r.row, r.final) for r in local]
