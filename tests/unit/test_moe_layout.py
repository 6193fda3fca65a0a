"""Expert layout (issue 38 item 1): megatron's expert RankGenerator order, validation, configs."""

import pytest
from megatron.core.parallel_state import RankGenerator

from hybridrl.config.parallel import ParallelConfig
from hybridrl.parallel.groups import EXPERT_AXES, all_rank_sets
from hybridrl.parallel.layout import TrainLayout, expert_lines, expert_summary

EXPERT_TOKENS = ["tp", "ep", "dp", "pp", "tp-ep", "tp-ep-pp"]


def _cases():
    for world in (1, 2, 4, 8, 12, 16, 24, 32, 64):
        for tp in (1, 2, 4):
            for pp in (1, 2, 4):
                if world % (tp * pp):
                    continue
                for etp in (1, tp):
                    for ep in (1, 2, 4, 8):
                        if world % (etp * ep * pp) == 0:
                            yield world, tp, pp, etp, ep


def test_expert_groups_equal_megatron_expert_rank_generator():
    seen = 0
    for world, tp, pp, etp, ep in _cases():
        layout = TrainLayout(world=world, tp=tp, pp=pp, ep=ep, etp=etp)
        dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1,
                              order="tp-cp-ep-dp-pp")
        edp = world // (etp * ep * pp)
        expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        assert layout.dp == world // (tp * pp) and layout.edp == edp
        for axes in ("tp", "pp", "dp", "tp-pp", "tp-dp"):  # the dense part is unchanged by ep
            assert layout.groups(axes) == dense.get_ranks(axes), (world, tp, pp, ep, axes)
        for axes in EXPERT_TOKENS:
            assert layout.expert_groups(axes) == expert.get_ranks(axes), (world, tp, pp, ep, axes)
        sets = all_rank_sets(layout, None)
        for name, axes in EXPERT_AXES.items():
            assert sets[name] == expert.get_ranks(axes)
        for rank in range(world):  # coords agree with the groups
            c = layout.expert_coords(rank)
            group = next(g for g in expert.get_ranks("ep") if rank in g)
            assert group.index(rank) == c["ep"]
            experts = layout.local_experts(rank, 8 * ep)
            assert list(experts) == list(range(c["ep"] * 8, c["ep"] * 8 + 8))
        seen += 1
    assert seen > 40


def test_expert_layout_validation_is_one_line():
    with pytest.raises(ValueError, match=r"world=4 is not divisible by etp\*ep\*pp = 1\*8\*1"):
        TrainLayout(world=4, ep=8)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep=4"):
        TrainLayout(world=4, ep=4).local_experts(0, 6)
    with pytest.raises(ValueError, match="does not end in pp"):  # megatron's rule
        TrainLayout(world=8, tp=1, pp=2, ep=2, order="tp-cp-ep-pp-dp")
    with pytest.raises(ValueError, match="cp must be 1"):
        TrainLayout(world=4, cp=2)


def test_parallel_config_accepts_ep_and_checks_the_world():
    cfg = ParallelConfig(tp=2, ep=2)
    assert cfg.expert_tp == 2 and cfg.resolve_dp(8) == 4 and cfg.model_parallel_size == 2
    assert ParallelConfig(tp=2, ep=4, etp=1).resolve_dp(4) == 2
    with pytest.raises(ValueError, match=r"parallel.etp\*ep\*pp = 2\*4\*1 = 8"):
        cfg = ParallelConfig(tp=2, ep=4)
        cfg.resolve_dp(4)
    with pytest.raises(ValueError, match="parallel.ep must be > 0"):
        ParallelConfig(ep=0)


def test_expert_lines_show_megatrons_expert_groups():
    train = TrainLayout(world=8, tp=2, ep=2)
    summary = expert_summary(train)
    assert (summary["ep_size"], summary["etp_size"], summary["edp_size"]) == (2, 2, 2)
    assert summary["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert summary["expt_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    lines = expert_lines(train)
    assert lines[0].startswith("expert groups: etp x ep x edp x pp = 2 x 2 x 2 x 1")
    assert lines[1] == "  ep        [0, 2], [1, 3], [4, 6], [5, 7]"


def test_hybridrl_layout_shows_the_expert_groups_and_the_entry_builds_them(capsys):
    """`hybridrl layout --ep/--etp` prints and returns the expert layout, and the trainer's
    layout reads parallel.ep / parallel.etp (both ignored it before the lead's wiring)."""
    import json

    from hybridrl.cli import main
    from hybridrl.config import load_config
    from hybridrl.trainer.entry import build_layout

    assert main(["layout", "--world", "16", "--tp", "2", "--ep", "4", "--etp", "1",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["experts"]
    want = expert_summary(TrainLayout(world=16, tp=2, ep=4, etp=1))
    assert got == json.loads(json.dumps(want)) and got["ep_size"] == 4 and got["etp_size"] == 1
    assert main(["layout", "--world", "16", "--tp", "2", "--ep", "4"]) == 0
    assert "expert groups: etp x ep x edp x pp = 2 x 4 x 2 x 1" in capsys.readouterr().out
    cfg = load_config([], ["parallel.ep=2", "parallel.tp=2", "parallel.etp=1"], world_size=8)
    train, _ = build_layout(cfg, 8)
    assert (train.ep, train.etp, train.edp) == (2, 1, 4)
