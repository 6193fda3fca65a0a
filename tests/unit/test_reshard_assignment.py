"""Placement-optimal gen coordinates (hybridrl.reshard.assignment), no process group.

The oracle is independent of the solver: a rank's received bytes for each gen shard are counted
element by element (sets of (key, row)), then every assignment of ranks to gen shards is tried.
"""

import itertools
import random

import pytest
import torch

from hybridrl.parallel.layout import TrainLayout
from hybridrl.planning.cli import main as plan_main
from hybridrl.reshard.assemble import Assembler
from hybridrl.reshard.assignment import min_cost_assignment
from hybridrl.reshard.executor import run_plan_local, train_sources
from hybridrl.reshard.formats import build_format
from hybridrl.reshard.placement import (
    default_gen_placement,
    gen_placement,
    train_placement,
)
from hybridrl.reshard.planner import plan_reshard
from hybridrl.reshard.specs import PRESETS, LlamaShape, build_specs
from hybridrl.reshard.summary import summarize
from tests.unit.test_reshard_oracle import (
    PAD,
    SMALL,
    engine_shards,
    make_hf,
    megatron_shards,
    mismatches,
)


def _div(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def test_min_cost_assignment_equals_brute_force():
    rng = random.Random(0)
    for n in range(1, 7):
        for _ in range(30):
            cost = [[rng.randint(-5, 9) for _ in range(n)] for _ in range(n)]
            cols = min_cost_assignment(cost)
            assert sorted(cols) == list(range(n))
            best = min(sum(cost[i][c] for i, c in enumerate(perm))
                       for perm in itertools.permutations(range(n)))
            assert sum(cost[i][c] for i, c in enumerate(cols)) == best, cost
    with pytest.raises(ValueError, match="square"):
        min_cost_assignment([[1, 2]])


def _rows(placement, specs, rank):
    """{(key, row)} of ``rank`` under ``placement``, by enumeration."""
    out = set()
    for s in specs:
        iv = placement.interval(s, rank)
        if iv is not None:
            out.update((s.key, i) for i in range(*iv))
    return out


def _recv_table(train, gen, specs, itemsize=2):
    """recv[r][j]: bytes rank r lacks of gen shard j = (g, q) (counted element by element)."""
    rep = {}
    for r, (g, q, _) in enumerate(gen.coords):
        rep.setdefault(g + gen.tp * q, r)
    row_bytes = {s.key: s.row_numel * itemsize for s in specs}
    table = []
    for r in range(train.world):
        held = _rows(train, specs, r)
        table.append([sum(row_bytes[k] for k, _ in _rows(gen, specs, rep[j]) - held)
                      for j in range(gen.tp * gen.pp)])
    return table


def _non_nested(max_world):
    for w in range(2, max_world + 1):
        for t, p in itertools.product(_div(w), _div(w)):
            if w % (t * p) or SMALL.num_query_groups % t or SMALL.layers % p:
                continue
            for tg, pg in itertools.product(_div(w), _div(w)):
                if (w % (tg * pg) or SMALL.num_query_groups % tg or SMALL.layers % pg
                        or (t % tg == 0 and p % pg == 0)):
                    continue
                yield w, t, p, tg, pg


def test_optimal_placement_moves_the_brute_force_minimum():
    specs = build_specs(SMALL)
    cases = better = 0
    for w, t, p, tg, pg in _non_nested(8):
        tl = TrainLayout(w, tp=t, pp=p)
        train = train_placement(tl, SMALL)
        opt = gen_placement(tl, SMALL, tg, pg, "optimal", vocab_pad=64)
        plain = gen_placement(tl, SMALL, tg, pg, "consecutive", vocab_pad=64)
        assert opt.grouping == "optimal" and default_gen_placement(tl, SMALL, tg, pg, 64) == opt
        table = _recv_table(train, plain, specs)
        slots = [j for j in range(tg * pg) for _ in range(w // (tg * pg))]
        best = min(sum(table[r][j] for r, j in enumerate(perm))
                   for perm in set(itertools.permutations(slots)))
        got = sum(summarize(train, opt, specs, "p2p", 2).recv)
        was = sum(summarize(train, plain, specs, "p2p", 2).recv)
        assert got == best, (w, t, p, tg, pg, got, best)
        assert sum(table[r][g + tg * q] for r, (g, q, _) in enumerate(opt.coords)) == best
        if tg * pg <= t * p and (t * p) % (tg * pg) == 0:  # gen replicas inside a DP replica
            for rep in range(w // (tg * pg)):
                members = [r for r, c in enumerate(opt.coords) if c[2] == rep]
                assert len({train.replica(r) for r in members}) == 1, (w, t, p, tg, pg, members)
        better += got < was
        cases += 1
    assert cases >= 20 and better >= 5, (cases, better)


def test_llama7b_world16_t2_p4_tg4_receives_three_sixteenths():
    shape = PRESETS["llama2-7b"]
    specs = build_specs(shape)
    tl = TrainLayout(16, tp=2, pp=4)
    train = train_placement(tl, shape)
    m = shape.num_params() * 2
    plain = max(summarize(train, gen_placement(tl, shape, 4, 1, "consecutive", 64), specs,
                          "p2p", 2).recv)
    opt = max(summarize(train, gen_placement(tl, shape, 4, 1, "optimal", 64), specs,
                        "p2p", 2).recv)
    assert abs(plain / m - 0.25) < 0.002 and abs(opt / m - 0.1875) < 0.005, (plain / m, opt / m)


@pytest.mark.parametrize("fmt", ["megatron", "engine"])
def test_optimal_placement_delivers_every_shard(fmt):
    """Executed locally (no process group): each rank assembles exactly its gen shard."""
    shape = LlamaShape(**{**SMALL.__dict__, "tied": True})
    hf = make_hf(shape)
    specs = build_specs(shape)
    for w, t, p, tg, pg in [(8, 2, 2, 4, 1), (8, 1, 4, 2, 2), (8, 2, 1, 4, 2), (4, 1, 1, 2, 1)]:
        tl = TrainLayout(w, tp=t, pp=p)
        train = train_placement(tl, shape)
        gen = gen_placement(tl, shape, tg, pg, "optimal", vocab_pad=64 if fmt == "engine" else None)
        plan = plan_reshard(train, gen, specs, "p2p", bucket_mb=0.01, itemsize=4)
        sources, asms = [], []
        for r in range(w):
            b, a, _ = train.coords[r]
            named = megatron_shards(shape, hf, t, b, p, a, train.vocab_chunk, pad_value=PAD)
            sources.append(train_sources(plan, r, named))
            asms.append(Assembler(plan, r, build_format(fmt, shape, gen, r), dtype=torch.float32))
        run_plan_local(plan, sources, asms)
        oracle = megatron_shards if fmt == "megatron" else engine_shards
        for r in range(w):
            gb, ga, _ = gen.coords[r]
            want = oracle(shape, hf, tg, gb, pg, ga, gen.vocab_chunk)
            assert mismatches(asms[r].result(), want) == [], (w, t, p, tg, pg, r)


def test_plan_cli_reports_the_placement(capsys):
    assert plan_main(["--model", "llama2-7b", "--world", "16", "--tp", "2", "--pp", "4",
                      "--gen-tp", "4", "--json"]) == 0
    import json

    rep = json.loads(capsys.readouterr().out)
    gen = rep["gen"]
    assert gen["grouping"] == "optimal"
    assert sorted(r for rep_ranks in gen["replicas"] for r in rep_ranks) == list(range(16))
    assert (rep["strategies"]["p2p"]["max_bytes_received_per_rank"]
            < gen["consecutive_p2p_max_bytes_received_per_rank"])
    assert plan_main(["--model", "llama2-7b", "--world", "16", "--tp", "2", "--pp", "4",
                      "--gen-tp", "4"]) == 0
    text = capsys.readouterr().out
    assert "grouping optimal" in text and "consecutive grouping would receive 3.369 GB" in text


def test_rollout_worker_places_non_nested_gen_optimally():
    from types import SimpleNamespace

    from hybridrl.rollout.worker import rollout_gen_placement

    tl = TrainLayout(8, tp=2, pp=2)
    gen, grouping = rollout_gen_placement(tl, SMALL, SimpleNamespace(tp=4, pp=1,
                                                                      grouping="hybridflow"))
    assert grouping == "optimal" and gen == gen_placement(tl, SMALL, 4, 1, "optimal", 64)
    gen, grouping = rollout_gen_placement(tl, SMALL, SimpleNamespace(tp=2, pp=1,
                                                                      grouping="hybridflow"))
    assert grouping == "hybridflow"
