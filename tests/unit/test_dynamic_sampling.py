"""DAPO dynamic sampling (hybridrl.trainer.dynamic_sampling) with a stand-in trainer: rounds
until B informative groups, truncation to B, filling when the rounds run out, distinct uids,
padding of different response widths, the refusals, and the metrics."""

import re
from types import SimpleNamespace

import pytest
import torch

from hybridrl.rollout.batch import RolloutBatch
from hybridrl.trainer.dynamic_sampling import collect, informative_groups

N_PER = 2  # rollout.n


class Prompts(list):
    pass


class StandIn:
    """Round k's prompt p gets scores SCORES[k][p] (one per sample); width R grows per round."""

    def __init__(self, scores, max_rounds=10, dp=1, n=N_PER, reward_model="", extras=False):
        self.scores, self.round, self.extras = scores, 0, extras
        self.cfg = SimpleNamespace(
            algorithm=SimpleNamespace(filter_groups=SimpleNamespace(
                enable=True, max_num_gen_batches=max_rounds)),
            rollout=SimpleNamespace(n=n), reward=SimpleNamespace(reward_model_path=reward_model))
        self.groups = SimpleNamespace(dp_size=dp, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        self.loader = SimpleNamespace(next_batch=lambda: Prompts(range(len(scores[0]))))
        self.dist_scorer = SimpleNamespace(score=self._score)
        self.partition = None

    def _rollout(self, prompts):
        B, R = len(prompts), 3 + self.round
        N = B * N_PER
        uid = [i for i in range(B) for _ in range(N_PER)]
        ids = torch.arange(N * R).reshape(N, R) + 1000 * self.round
        rb = RolloutBatch([[7, self.round, u] for u in uid], ids, torch.ones(N, R, dtype=torch.long),
                          torch.full((N, R), -float(self.round)), uid, [str(u) for u in uid],
                          ["src"] * N, [{"round": self.round}] * N)
        if self.extras:  # a multi-turn loss mask and a MoE engine's routing, per round
            rb.loss_mask = (ids % 2) * (self.round + 1)
            rb.routed_experts = (ids[:, :, None, None] + torch.zeros(1, 1, 2, 2,
                                                                     dtype=torch.long))
        return rb

    def _score(self, rows, response_ids, mask, gt, ds, extra, mp_index, mp_size):
        flat = [s for p in self.scores[self.round] for s in p]
        self.round += 1
        return torch.tensor(flat), {"critic/score/mean": sum(flat) / len(flat)}


def test_informative_groups():
    assert informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5]), [0, 0, 1, 1, 2]) == {1}


def test_rounds_until_enough_then_truncated():
    # B = 3 prompts; round 0: prompt 1 informative; round 1: prompts 0, 2; round 2: all (unused)
    scores = [[(1, 1), (0, 1), (0, 0)], [(0, 1), (1, 1), (1, 0)], [(0, 1)] * 3]
    t = StandIn(scores)
    rb, s, reward_metrics, m = collect(t, Prompts(range(3)))
    assert m["dynamic_sampling/rounds"] == 2 and m["dynamic_sampling/filled_groups"] == 0
    assert m["dynamic_sampling/informative_groups"] == 3
    assert m["dynamic_sampling/dropped_groups"] == 3 and m["dynamic_sampling/dropped_frac"] == 0.5
    assert len(rb) == 6 and rb.uid == [1, 1, 3, 3, 5, 5]  # round 1's uids are offset by B
    assert s.tolist() == [0, 1, 0, 1, 1, 0]
    assert rb.response_ids.shape == (6, 4)  # round 0's width 3 padded to 4
    assert rb.response_mask[:2, 3].tolist() == [0, 0] and rb.response_mask[2:, 3].tolist() == [1] * 4
    assert [e["round"] for e in rb.extra_info] == [0, 0, 1, 1, 1, 1]
    assert reward_metrics == {"critic/score/mean": 0.5}  # round 0's (unfiltered) metrics
    assert t.partition == ([list(range(6))], rb.seq_lengths) and rb.rows == list(range(6))
    for g in set(rb.uid):
        assert len(set(s[[j for j, u in enumerate(rb.uid) if u == g]].tolist())) == 2


def test_merged_rounds_keep_the_loss_mask_and_the_routing():
    """Rows kept from different rounds keep their loss_mask (issue 41) and routed_experts
    (issue 38), padded to the widest round (was: both dropped by the merge)."""
    scores = [[(1, 1), (0, 1), (0, 0)], [(0, 1), (1, 1), (1, 0)]]
    rb, *_ = collect(StandIn(scores, extras=True), Prompts(range(3)))
    assert rb.loss_mask is not None and rb.routed_experts is not None
    assert rb.loss_mask.shape == (6, 4) and rb.routed_experts.shape == (6, 4, 2, 2)
    assert rb.loss_mask[:2, 3].tolist() == [0, 0]  # round 0's width 3, padded
    assert torch.equal(rb.loss_mask[:2, :3], (rb.response_ids[:2, :3] % 2) * 1)
    assert torch.equal(rb.loss_mask[2:], (rb.response_ids[2:] % 2) * 2)  # round 1's rows
    assert torch.equal(rb.routed_experts[2:, :, 0, 1], rb.response_ids[2:])
    assert rb.routed_experts[:2, 3].eq(0).all()


def test_rounds_are_bounded_and_the_batch_filled():
    scores = [[(1, 1), (0, 1), (0, 0)]] * 5
    rb, s, _, m = collect(StandIn(scores, max_rounds=2), Prompts(range(3)))
    assert m["dynamic_sampling/rounds"] == 2 and m["dynamic_sampling/filled_groups"] == 1
    assert len(rb) == 6 and len(set(rb.uid)) == 3
    assert informative_groups(s, rb.uid) == {1, 4}  # the filled group has equal scores


@pytest.mark.parametrize("kwargs,key", [({"reward_model": "/rm"}, "reward_model_path"),
                                        ({"n": 1}, "rollout.n >= 2")])
def test_refusals(kwargs, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        collect(StandIn([[(1, 0)]], **kwargs), Prompts(range(1)))


@pytest.mark.parametrize("overrides,fragment", [
    (["algorithm.filter_groups.enable=true", "rollout.n=1"], "needs rollout.n >= 2"),
    (["algorithm.filter_groups.enable=true", "reward.reward_model_path=/rm"], "reward_model_path"),
    (["algorithm.filter_groups.max_num_gen_batches=0"], "max_num_gen_batches must be"),
    (["reward.overlong_buffer=600", "rollout.response_length=512"], "must be <= rollout"),
])
def test_config_refusals_at_load(overrides, fragment):
    from hybridrl.config import load_config

    with pytest.raises(ValueError, match=re.escape(fragment)):
        load_config([], overrides)
