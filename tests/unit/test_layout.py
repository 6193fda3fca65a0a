"""Pure layout math: megatron-core RankGenerator equality, partitions, shard nesting, validation."""

import itertools

import pytest
from megatron.core.parallel_state import RankGenerator

from hybridrl.parallel.groups import all_rank_sets
from hybridrl.parallel.layout import GenLayout, TrainLayout

WORLDS = [*range(1, 65), 128, 256, 512, 1024]
AXES = ["tp", "pp", "dp", "cp", "ep", "tp-pp", "tp-dp", "dp-pp", "cp-dp", "tp-cp-dp", "tp-ep-pp"]


def divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def factorizations(world):
    for tp in divisors(world):
        for pp in divisors(world // tp):
            yield tp, pp, world // tp // pp


def all_layouts():
    for world in WORLDS:
        for tp, pp, dp in factorizations(world):
            yield world, tp, pp, dp


def assert_partition(groups, world):
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(world))


@pytest.mark.parametrize("world", WORLDS)
def test_groups_equal_megatron_rank_generator(world):
    for tp, pp, dp in factorizations(world):
        layout = TrainLayout(world=world, tp=tp, pp=pp)
        assert layout.dp == dp
        ref = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        for axes in AXES:
            ours = layout.groups(axes)
            assert ours == ref.get_ranks(axes), (world, tp, pp, axes)
            assert_partition(ours, world)


def test_other_orders_match_megatron():
    for order in ["tp-dp-pp", "tp-pp-dp", "pp-dp-tp", "dp-tp-pp"]:
        for world, tp, pp, dp in [(8, 2, 2, 2), (24, 2, 3, 4), (16, 4, 2, 2)]:
            layout = TrainLayout(world=world, tp=tp, pp=pp, order=order)
            ref = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
            for axes in ["tp", "pp", "dp", "tp-pp"]:
                assert layout.groups(axes) == ref.get_ranks(axes), (order, axes)


def test_coords_and_rank_are_inverse():
    layout = TrainLayout(world=24, tp=2, pp=3)
    for r in range(24):
        c = layout.coords(r)
        assert layout.rank(**c) == r
        assert r in layout.group_of(r, "tp") and layout.group_of(r, "tp")[c["tp"]] == r


def gen_options(tp, pp):
    return itertools.product(divisors(tp), divisors(pp))


def check_gen(world, tp, pp, tg, pg, grouping):
    train = TrainLayout(world=world, tp=tp, pp=pp)
    gen = GenLayout(train, tp=tg, pp=pg, grouping=grouping)
    assert gen.dg * tg * pg * train.dp == world
    sets = all_rank_sets(train, gen)
    for name in ("gen_tp", "gen_pp", "micro_dp", "gen_dp"):
        assert_partition(sets[name], world)
    assert {len(g) for g in sets["gen_tp"]} == {tg}
    assert {len(g) for g in sets["gen_pp"]} == {pg}
    assert {len(g) for g in sets["micro_dp"]} == {gen.dg}
    # micro-DP x gen TP x gen PP x DP: every combination of the four coordinates exactly once
    seen = {dataclass_tuple(gen.coords(r)) for r in range(world)}
    assert len(seen) == world
    # inside a gen TP group, gen_tp runs over 0..tg-1 in rank order (ranks are TP peers)
    for g in sets["gen_tp"]:
        assert sorted(gen.coords(r).gen_tp for r in g) == list(range(tg))
    layers, cols = 2 * pp, 2 * tp
    for r in range(world):
        tr, ge = train.train_shard(r, layers, cols), gen.gen_shard(r, layers, cols)
        if grouping == "hybridflow":
            assert ge.contains(tr), (world, tp, pp, tg, pg, r)
    return gen


def dataclass_tuple(c):
    return (c.gen_tp, c.gen_pp, c.micro_dp, c.dp)


@pytest.mark.parametrize("world", [*range(1, 65), 128])
def test_gen_layout_hybridflow_nests_and_partitions(world):
    for _, tp, pp, _dp in [(world, *f) for f in factorizations(world)]:
        for tg, pg in gen_options(tp, pp):
            check_gen(world, tp, pp, tg, pg, "hybridflow")


def test_gen_layout_large_worlds():
    for world in (256, 512):  # every (tp, pp) up to 16 each (1024 doubled the time, found nothing new)
        for tp, pp, _ in factorizations(world):
            if tp <= 16 and pp <= 16:
                for tg, pg in gen_options(tp, pp):
                    check_gen(world, tp, pp, tg, pg, "hybridflow")


@pytest.mark.parametrize("world", [8, 12, 16, 24])
def test_gen_layout_vanilla_partitions(world):
    for tp, pp, _ in factorizations(world):
        for tg, pg in gen_options(tp, pp):
            check_gen(world, tp, pp, tg, pg, "vanilla")


def test_vanilla_shards_do_not_nest_where_hybridflow_does():
    # train 1-4-2, gen 1-2-2-2 (the worked example of docs/parallel.md)
    train = TrainLayout(world=8, tp=4, pp=1)
    hf, va = GenLayout(train, tp=2), GenLayout(train, tp=2, grouping="vanilla")
    assert hf.tp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert hf.micro_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert va.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert va.micro_dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    nested = [va.gen_shard(r, 1, 4).contains(train.train_shard(r, 1, 4)) for r in range(8)]
    assert not all(nested)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(world=10, tp=4), ["world=10", "tp=4"]),
        (dict(world=8, tp=0), ["tp", "positive"]),
        (dict(world=-1), ["world", "positive"]),
        (dict(world=8, tp=2, pp=2, dp=3), ["must equal world=8"]),
        (dict(world=8, tp=2, order="tp-xx-dp-pp"), ["order", "'xx'"]),
        (dict(world=8, tp=2, order="tp-dp-tp"), ["order", "repeated"]),
        (dict(world=8, tp=2, pp=2, order="tp-dp"), ["order", "'pp'"]),
        (dict(world=8, cp=2), ["cp"]),
    ],
)
def test_train_layout_validation(kwargs, words):
    with pytest.raises(ValueError) as err:
        TrainLayout(**kwargs)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tp=3), ["gen tp=3", "train tp=4", "[1, 2, 4]"]),
        (dict(pp=4), ["gen pp=4", "train pp=2"]),
        (dict(tp=0), ["gen tp", "positive"]),
        (dict(grouping="magic"), ["grouping", "hybridflow"]),
    ],
)
def test_gen_layout_validation(kwargs, words):
    train = TrainLayout(world=16, tp=4, pp=2)
    with pytest.raises(ValueError) as err:
        GenLayout(train, **kwargs)
    for w in words:
        assert w in str(err.value)
