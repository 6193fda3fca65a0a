"""The ``split`` reshard plan: generation ranks apart from training ranks (no process group).

Checked on the plan alone, for layouts with tg != t and pg != p: each generation rank receives
exactly its gen shard's bytes, once, from training ranks only; training ranks receive nothing;
every destination row is covered exactly once; the sending is balanced over the training ranks
(max / mean within 10 % on a model whose pieces split evenly, and the rotation is what balances
it: without it the first DP replica would send everything); the other strategies refuse.
"""

import pytest

from hybridrl.parallel.layout import TrainLayout
from hybridrl.reshard.placement import split_placements
from hybridrl.reshard.planner import Sourcer, plan_reshard, send_balance
from hybridrl.reshard.specs import LlamaShape, build_specs
from tests.unit.test_reshard_oracle import SMALL

LAYOUTS = [  # (train world, t, p, gen world, tg, pg)
    (4, 2, 2, 4, 2, 1),
    (4, 1, 1, 4, 4, 1),
    (6, 2, 1, 2, 2, 1),
    (4, 2, 2, 4, 1, 2),
    (2, 2, 1, 6, 1, 1),
    (4, 4, 1, 4, 2, 2),
]


def _plan(tw, t, p, gw, tg, pg, shape=SMALL, strategy="split"):
    train, gen = split_placements(TrainLayout(tw, tp=t, pp=p), shape, gw, tg, pg)
    return train, gen, plan_reshard(train, gen, build_specs(shape), strategy, bucket_mb=0.02,
                                    itemsize=4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_gen_rank_receives_exactly_its_shard_from_training_ranks(layout):
    tw = layout[0]
    train, gen, plan = _plan(*layout)
    world = train.world
    assert world == tw + layout[3] and train.members == tuple(range(tw))
    for r in range(world):
        if r < tw:
            assert plan.recv_bytes(r) == 0 and plan.dests[r] == {} and plan.locals[r] == ()
            continue
        assert plan.sent_bytes(r) == 0
        assert plan.recv_bytes(r) == plan.dest_bytes(r) > 0
        got: dict[str, list] = {}
        for bucket in plan.buckets:
            for tr in bucket:
                if tr.dst == r:
                    assert tr.src < tw
                    got.setdefault(tr.key, []).append((tr.lo, tr.hi))
        assert set(got) == set(plan.dests[r])
        for key, (lo, hi) in plan.dests[r].items():
            rows = sorted(got[key])
            assert rows[0][0] == lo and rows[-1][1] == hi
            assert all(a[1] == b[0] for a, b in zip(rows, rows[1:])), (key, rows)


BIG = LlamaShape(hidden=512, ffn=1024, heads=8, num_query_groups=4, layers=2, vocab=1024,
                 head_dim=64, make_vocab_size_divisible_by=8)  # matrices over 64K elements a shard


def test_sending_is_balanced_over_the_training_replicas():
    # every rank holds equal bytes (pp 1): the sends must be within 10 % of the mean
    shape = BIG
    for layout in [(4, 2, 1, 4, 1, 1), (4, 1, 1, 4, 2, 1), (6, 2, 1, 4, 2, 1), (8, 2, 1, 2, 1, 1),
                   (6, 1, 1, 2, 2, 1)]:
        train, gen, plan = _plan(*layout, shape=shape)
        assert send_balance(plan) <= 1.10, (layout, send_balance(plan))
        assert {r for b in plan.buckets for tr in b for r in [tr.src]} == set(range(layout[0]))


def test_the_rotation_is_what_balances_small_pieces(monkeypatch):
    # a model of small pieces only (each sent whole): without the rotation over replicas and
    # keys, the first holder of every piece, rank 0, would send everything
    rotated = _plan(4, 1, 1, 2, 1, 1)[2]  # 4 DP replicas -> 2 gen replicas
    monkeypatch.setattr(Sourcer, "__init__", _no_rotation(Sourcer.__init__))
    fixed = _plan(4, 1, 1, 2, 1, 1)[2]
    assert send_balance(rotated) <= 1.25, send_balance(rotated)
    assert send_balance(fixed) > 3.9 and fixed.sent_bytes(0) == sum(
        fixed.sent_bytes(r) for r in range(4))


def _no_rotation(init):
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._ordinal = dict.fromkeys(self._ordinal, 0)
        orig = self._rotated_owners
        self._rotated_owners = lambda key, rep: orig(key, 0)
    return wrapped


def test_other_strategies_refuse_disjoint_sets_and_split_refuses_colocated():
    train, gen = split_placements(TrainLayout(4, tp=2, pp=2), SMALL, 4, 2, 1)
    for strategy in ("p2p", "zero_redundancy", "allgather", "vanilla"):
        with pytest.raises(ValueError, match="apart from the training ranks"):
            plan_reshard(train, gen, build_specs(SMALL), strategy)
    from hybridrl.reshard.placement import gen_placement, train_placement

    tl = TrainLayout(4, tp=2, pp=2)
    with pytest.raises(ValueError, match="split: needs the generation ranks apart"):
        plan_reshard(train_placement(tl, SMALL), gen_placement(tl, SMALL, 2, 1), build_specs(SMALL),
                     "split")


def test_bad_split_layouts_are_one_line():
    with pytest.raises(ValueError, match=r"gen tp\*pp=4\*1 must divide the generation ranks \(6\)"):
        split_placements(TrainLayout(2, tp=2), SMALL, 6, 4, 1)
    with pytest.raises(ValueError, match="gen world must be a positive integer"):
        split_placements(TrainLayout(2, tp=2), SMALL, 0, 1, 1)
    with pytest.raises(ValueError, match="vocab_pad must be a positive integer"):
        split_placements(TrainLayout(2, tp=2), SMALL, 2, 1, 1, vocab_pad=0)
