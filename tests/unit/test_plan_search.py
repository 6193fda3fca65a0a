"""``hybridrl plan --search``: it returns only layouts ``plan --memory`` accepts, best first."""

from __future__ import annotations

import json

import pytest

from hybridrl.planning.cli import main
from hybridrl.planning.search import candidates
from hybridrl.planning.timecli import SPLIT_TRAIN_PHASES
from hybridrl.reshard.specs import preset

WORK = ["--prompts", "128", "--n", "8", "--prompt-len", "512", "--max-response-len", "1024"]


def _json(argv: list[str], capsys) -> dict:
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _layout_flags(lay: dict) -> list[str]:
    flags = ["--tp", str(lay["tp"]), "--pp", str(lay["pp"]), "--gen-tp", str(lay["gen_tp"]),
             "--max-tokens-per-gpu", str(lay["tokens_per_gpu"]), "--recompute", lay["recompute"]]
    flags += ["--sp"] if lay["sp"] else []
    flags += ["--offload", ",".join(lay["offload"])] if lay["offload"] else []
    return flags


@pytest.mark.parametrize("model, world, gb", [("llama-3.1-8b", 16, 40), ("qwen3-8b", 8, 80)])
def test_search_returns_only_what_plan_memory_accepts(model, world, gb, capsys):
    rep = _json(["--search", "--model", model, "--world", str(world), "--gpu", "h100",
                 "--gpu-gb", str(gb), "--top", "8", *WORK], capsys)
    assert 0 < len(rep["best"]) <= 8 and rep["fit"] < rep["evaluated"]
    steps = [r["step_s"] for r in rep["best"]]
    assert steps == sorted(steps)
    for r in rep["best"]:
        lay = r["layout"]
        split = lay["placement"] == "split"
        train_world = world - lay["gen_world"] if split else world
        mem = _json(["--memory", "--model", model, "--world", str(train_world), "--gpu-gb",
                     str(gb), *_layout_flags(lay), "--seq-len", "1536", "--rollout-seqs", "1024",
                     "--no-critic"], capsys)
        if split:  # the training ranks run these phases only; the engine has GPUs of its own
            assert max(mem["totals"][p] for p in SPLIT_TRAIN_PHASES
                       if p in mem["totals"]) <= gb * 1e9
            assert r["memory"]["gen_ranks"]["fits"]
        else:
            assert mem["fits"], (lay, mem.get("overflow"))
            assert r["memory"]["headroom_bytes"] == mem["headroom_bytes"]
        # the search's figures are plan --time's for the same layout
        again = _json(["--time", "--model", model, "--world", str(world), "--gpu", "h100",
                       "--gpu-gb", str(gb), *WORK, *_layout_flags(lay),
                       *(["--placement", "split", "--gen-world", str(lay["gen_world"])]
                         if split else [])], capsys)
        assert again["step_s"] == pytest.approx(r["step_s"])


def test_candidates_are_valid_layouts():
    shape = preset("llama-3.1-70b")
    cands = candidates(256, shape, 8, 3072)
    assert cands
    for c in cands:
        train = 256 - c["gen_world"]
        assert train % (c["tp"] * c["pp"]) == 0 and shape.layers % c["pp"] == 0
        assert shape.num_query_groups % c["tp"] == 0 and (c["tp"] * c["pp"]) % c["gen_tp"] == 0
        assert c["max_tokens_per_gpu"] >= 3072 and (c["sp"] is False or c["tp"] > 1)
        if c["placement"] == "split":
            assert c["gen_world"] % 8 == 0 and c["gen_world"] % c["gen_tp"] == 0
    # the 256-GPU config's own layout is among them
    assert any((c["tp"], c["pp"], c["gen_tp"], c["placement"]) == (8, 4, 4, "colocated")
               for c in cands)


def test_nothing_fits_is_one_line(capsys):
    assert main(["--search", "--model", "llama-3.1-70b", "--world", "2", "--gpu", "h100",
                 *WORK]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no layout" in err
