"""8 gloo ranks build real groups for two layouts in one process group.

(tp, pp, dp) = (2, 2, 2) with gen (tg, pg) = (2, 1), and (4, 2, 1) with gen (2, 2), where gen TP
(stride 2), gen PP and micro-DP groups are all non-trivial. For each layout the test checks every
family: an all_reduce of the global rank inside each of this
rank's groups equals the sum of the group's members computed from the pure layout, and
megatron-core's view after the hand-off equals hybridrl's.
"""

import pytest

from hybridrl.parallel.groups import all_rank_sets
from hybridrl.parallel.layout import GenLayout, TrainLayout
from hybridrl.testing.dist import run_on_ranks


def _layouts(world, tp, pp, gen_tp, gen_pp):
    train = TrainLayout(world=world, tp=tp, pp=pp)
    return train, GenLayout(train, tp=gen_tp, pp=gen_pp)


def _groups_rank(rank, world, cases):
    return [_one_layout(rank, world, *case) for case in cases]


def _one_layout(rank, world, tp, pp, gen_tp, gen_pp):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.megatron import apply_megatron_groups, clear_megatron_groups

    train, gen = _layouts(world, tp, pp, gen_tp, gen_pp)
    groups = build_groups(train, gen)
    sums = {}
    for name, pg in groups.groups.items():
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pg)
        sums[name] = (t.item(), dist.get_world_size(pg), dist.get_rank(pg))
    pgc = apply_megatron_groups(groups)
    view = {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "dp_rank": ps.get_data_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(),
        "first": ps.is_pipeline_first_stage(),
        "last": ps.is_pipeline_last_stage(),
        "pgc_tp_rank": dist.get_rank(pgc.tp),
        "pgc_pp_size": dist.get_world_size(pgc.pp),
    }
    ours = {
        "tp_rank": groups.tp_rank,
        "tp_size": groups.tp_size,
        "pp_rank": groups.pp_rank,
        "pp_size": groups.pp_size,
        "dp_rank": groups.dp_rank,
        "dp_size": groups.dp_size,
        "first": groups.is_first_stage,
        "last": groups.is_last_stage,
        "pgc_tp_rank": groups.tp_rank,
        "pgc_pp_size": groups.pp_size,
    }
    clear_megatron_groups()
    apply_megatron_groups(groups)  # apply/clear twice: hybridrl's groups must survive megatron
    clear_megatron_groups()
    for name, pg in groups.groups.items():
        t = torch.tensor([1.0])
        dist.all_reduce(t, group=pg)
        assert t.item() == len(groups.members[name]), (name, "group destroyed by megatron")
        assert dist.get_process_group_ranks(pg) == list(groups.members[name]), name  # registered
    return sums, view, ours


CASES = [(2, 2, 2, 1), (4, 2, 2, 2)]  # (tp, pp, gen_tp, gen_pp) on 8 ranks


@pytest.mark.slow
def test_groups_allreduce_and_megatron_view():
    world = 8
    per_rank = run_on_ranks(_groups_rank, world, CASES, timeout=240)
    for i, case in enumerate(CASES):
        _check_case(world, case, [r[i] for r in per_rank])


def _check_case(world, case, results):
    train, gen = _layouts(world, *case)
    expected_sets = all_rank_sets(train, gen)
    assert max(len(g) for g in expected_sets["micro_dp"]) > 1
    for rank, (sums, view, ours) in enumerate(results):
        assert view == ours, f"rank {rank}: megatron {view} != hybridrl {ours}"
        mine = {name for name, sets in expected_sets.items() if any(rank in g for g in sets)}
        assert set(sums) == mine, rank
        for name, (total, size, index) in sums.items():
            (members,) = [g for g in expected_sets[name] if rank in g]
            assert total == sum(members), (rank, name)
            assert size == len(members) and index == members.index(rank), (rank, name)
    coords = [train.coords(r) for r in range(world)]
    assert [v["tp_rank"] for _, v, _ in results] == [c["tp"] for c in coords]
    assert [v["pp_rank"] for _, v, _ in results] == [c["pp"] for c in coords]
    assert [v["dp_rank"] for _, v, _ in results] == [c["dp"] for c in coords]


def _inconsistent_gen_on_rank1(rank, world):
    from hybridrl.parallel.groups import build_groups

    train = TrainLayout(world=world, tp=2)
    other = TrainLayout(world=world, tp=1)
    gen = GenLayout(other if rank == 1 else train, tp=1)
    try:
        build_groups(train, gen)
    except ValueError as err:
        return str(err)
    return None


def test_a_bad_layout_on_one_rank_fails_every_rank():
    errors = run_on_ranks(_inconsistent_gen_on_rank1, 2, timeout=120)
    assert all(e and "rank 1: gen layout was derived" in e for e in errors), errors
