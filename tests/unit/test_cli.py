"""`hybridrl layout`: JSON contents against the pure layout, the human form, bad input -> exit 2."""

import json
import subprocess
import sys

import pytest

from hybridrl.cli import main
from hybridrl.parallel.layout import GenLayout, TrainLayout


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def is_sorted_groups(groups):
    return all(g == sorted(g) for g in groups) and [g[0] for g in groups] == sorted(
        g[0] for g in groups
    )


@pytest.mark.parametrize(
    "world, tp, pp, gtp, gpp", [(8, 4, 1, 2, 1), (16, 2, 4, 2, 2), (256, 8, 4, 4, 1), (12, 3, 2, 1, 2)]
)
def test_layout_json_matches_layout(capsys, world, tp, pp, gtp, gpp):
    code, out, _ = run(capsys, "layout", "--world", str(world), "--tp", str(tp), "--pp", str(pp),
                       "--gen-tp", str(gtp), "--gen-pp", str(gpp), "--json")
    assert code == 0
    obj = json.loads(out)
    train = TrainLayout(world=world, tp=tp, pp=pp)
    gen = GenLayout(train, tp=gtp, pp=gpp)
    assert obj["world"] == world
    for axis in ("tp", "pp", "dp"):
        assert sorted(map(sorted, train.groups(axis))) == obj["train"][axis]
        assert is_sorted_groups(obj["train"][axis])
    assert obj["gen"]["dg"] == (tp * pp) // (gtp * gpp)
    for key, groups in [("tp", gen.tp_groups()), ("pp", gen.pp_groups()),
                        ("micro_dp", gen.micro_dp_groups())]:
        assert obj["gen"][key] == groups and is_sorted_groups(groups)
        assert sorted(r for g in groups for r in g) == list(range(world))


def test_layout_human_form_lists_shards(capsys):
    code, out, _ = run(capsys, "layout", "--world", "8", "--tp", "4", "--gen-tp", "2")
    assert code == 0
    assert "dg = p*t/(pg*tg) = 2" in out
    assert "micro_dp  [0, 1], [2, 3], [4, 5], [6, 7]" in out
    rank_rows = [line for line in out.splitlines() if "|" in line and line.split()[0].isdigit()]
    assert len(rank_rows) == 8


def test_vanilla_grouping_flag(capsys):
    code, out, _ = run(capsys, "layout", "--world", "8", "--tp", "4", "--gen-tp", "2",
                       "--grouping", "vanilla", "--json")
    assert code == 0 and json.loads(out)["gen"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--world", "10", "--tp", "4"], ["world=10", "tp"]),
        (["--world", "8", "--tp", "4", "--gen-tp", "3"], ["gen tp=3"]),
        (["--world", "8", "--tp", "0"], ["tp must be a positive integer"]),
        (["--world", "8", "--grouping", "x"], ["grouping"]),
        (["--world", "eight"], ["--world"]),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, words):
    code, out, err = run(capsys, "layout", *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridrl layout: error:")
    for w in words:
        assert w in lines[0]


def test_module_entry_point_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "layout", "--world", "10",
                           "--tp", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "world=10" in proc.stderr


def test_train_failure_lines_rank0_at_once_others_late_with_rank(capsys, monkeypatch):
    from hybridrl import train

    monkeypatch.setattr(train, "RANK_ERROR_DELAY_S", 0.0)
    assert train._fail(0, 2, "actor.lr must be > 0") == 2
    assert capsys.readouterr().err == "hybridrl.train: error: actor.lr must be > 0\n"
    slept = []
    monkeypatch.setattr(train.time, "sleep", slept.append)
    assert train._fail(3, 1, "no such file") == 1
    assert capsys.readouterr().err == "hybridrl.train: error (rank 3): no such file\n"
    assert slept == [0.0]  # waited (RANK_ERROR_DELAY_S) before writing
