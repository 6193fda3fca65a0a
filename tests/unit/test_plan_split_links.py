"""``hybridrl plan --gen-world N --link-gbps LIST`` (issue 39 item 2): bytes per rank and the
weight sync's seconds at each link speed (the busiest rank's bytes over the link), in the JSON and
the text; a bad list is one line."""

from __future__ import annotations

import json

import pytest

from hybridrl.planning.cli import main

ARGS = ["--model", "llama-3.1-70b", "--world", "256", "--tp", "8", "--pp", "2",
        "--gen-world", "64", "--gen-tp", "8"]


def test_seconds_at_each_link_speed(capsys):
    assert main([*ARGS, "--link-gbps", "25,200,400", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    recv, sent = rep["received_per_gen_rank"], rep["sent_per_train_rank"]
    assert len(recv) == 64 and len(sent) == 192
    busiest = max(max(recv), max(sent))
    assert rep["busiest_bytes"] == busiest
    assert set(rep["seconds_at_gbps"]) == {"25", "200", "400"}
    for g, s in rep["seconds_at_gbps"].items():
        assert s == pytest.approx(busiest * 8 / (float(g) * 1e9))
    # a gen rank of a tg-8 replica receives its shard, ~M/8 (bf16 70B: ~141 GB / 8)
    assert max(recv) == pytest.approx(rep["model_bytes"] / 8, rel=0.01)
    assert rep["seconds_at_gbps"]["25"] == pytest.approx(16 * rep["seconds_at_gbps"]["400"])


def test_text_lists_the_links(capsys):
    assert main([*ARGS, "--link-gbps", "100,400"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "per link" in x]
    assert len(line) == 1 and "@ 100 Gb/s" in line[0] and "@ 400 Gb/s" in line[0]


@pytest.mark.parametrize("bad", ["", "fast", "100,-1", "0"])
def test_bad_link_list_is_one_line(bad, capsys):
    assert main([*ARGS, "--link-gbps", bad]) == 2
    err = capsys.readouterr().err
    assert "--link-gbps must be positive" in err and err.count("\n") == 1
