"""Pure planner tests (no process group): coverage, Table-2 bytes, p2p minimality, formats.

Every layout of <= 16 ranks: world W, train (t, p) with t*p | W, gen (tg, pg) with tg | t, pg | p.
"""

import itertools
from fractions import Fraction

import pytest
import torch

from hybridrl.parallel.layout import TrainLayout
from hybridrl.reshard.assemble import Assembler
from hybridrl.reshard.executor import run_plan_local, train_sources
from hybridrl.reshard.formats import build_format, hf_format, hf_to_canonical
from hybridrl.reshard.placement import gen_placement, train_placement
from hybridrl.reshard.planner import STRATEGIES, plan_reshard
from hybridrl.reshard.specs import LlamaShape, build_specs
from hybridrl.reshard.summary import summarize, table2
from tests.unit.test_reshard_oracle import (
    PAD,
    SMALL,
    balanced,
    engine_shards,
    make_hf,
    megatron_shards,
    mismatches,
)


def _div(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def _layouts(max_world=16):
    for w in range(1, max_world + 1):
        for t, p in itertools.product(_div(w), _div(w)):
            if w % (t * p) == 0:
                for tg, pg in itertools.product(_div(t), _div(p)):
                    yield w, t, p, tg, pg


def _coverage(plan, specs):
    """Every destination row is delivered exactly once (locals + transfers)."""
    for r in range(plan.train.world):
        got: dict[str, list[tuple[int, int]]] = {}
        for key, lo, hi in plan.locals[r]:
            got.setdefault(key, []).append((lo, hi))
        for b in plan.buckets:
            for t in b:
                if t.dst == r:
                    got.setdefault(t.key, []).append((t.lo, t.hi))
        assert set(got) <= set(plan.dests[r])
        for key, (lo, hi) in plan.dests[r].items():
            ivs = sorted(got.get(key, []))
            assert ivs and ivs[0][0] == lo and ivs[-1][1] == hi, (r, key, ivs)
            assert all(a[1] == b[0] for a, b in zip(ivs, ivs[1:])), (r, key, ivs)  # no gap/overlap


def test_table2_exact_and_coverage_all_layouts_up_to_16_ranks():
    n = 0
    for w, t, p, tg, pg in _layouts():
        d, dg = w // (t * p), (t * p) // (tg * pg)
        shape, specs = balanced(t, p, d)
        M = sum(s.numel for s in specs) * 2
        train = train_placement(TrainLayout(w, tp=t, pp=p), shape)
        for strategy in STRATEGIES:
            grouping = "vanilla" if strategy == "vanilla" else "hybridflow"
            gen = gen_placement(TrainLayout(w, tp=t, pp=p), shape, tg, pg, grouping)
            s = summarize(train, gen, specs, strategy, 2)
            want = table2(strategy, t, p, d, dg, M)
            assert all(Fraction(x) == want for x in s.recv), (w, t, p, tg, pg, strategy, s.recv, want)
            if w <= 8:  # full plans: coverage and plan == summary
                plan = plan_reshard(train, gen, specs, strategy, bucket_mb=0.05)
                _coverage(plan, specs)
                assert [plan.recv_bytes(r) for r in range(w)] == list(s.recv)
                assert [plan.sent_bytes(r) for r in range(w)] == list(s.sent)
                n += 1
    assert n > 100


def _any_gen(w, shape):
    """Every (tg, pg) whose product divides w and that the shape allows."""
    for tg, pg in itertools.product(_div(w), _div(w)):
        if w % (tg * pg) == 0 and shape.num_query_groups % tg == 0 and shape.layers % pg == 0:
            yield tg, pg


def _minimum(train, gen, specs, r, itemsize):
    """Bytes of r's gen shard that r does not hold already (computed from intervals directly)."""
    total = 0
    for s in specs:
        iv = gen.interval(s, r)
        if iv is None:
            continue
        held = [train.interval(x, r) for x in specs if x.key == s.key]
        have = sum(max(0, min(iv[1], h[1]) - max(iv[0], h[0])) for h in held if h is not None)
        total += (iv[1] - iv[0] - have) * s.row_numel * itemsize
    return total


def test_p2p_is_minimal_for_any_gen_layout():
    specs = build_specs(SMALL)
    cases = 0
    for w in (1, 2, 4, 6, 8, 12, 16):
        for t, p in itertools.product(_div(w), _div(w)):
            if w % (t * p) or SMALL.num_query_groups % t or SMALL.layers % p:
                continue
            tl = TrainLayout(w, tp=t, pp=p)
            train = train_placement(tl, SMALL)
            for tg, pg in _any_gen(w, SMALL):
                nested = t % tg == 0 and p % pg == 0
                gen = gen_placement(tl, SMALL, tg, pg, "hybridflow" if nested else "consecutive")
                s = summarize(train, gen, specs, "p2p", 2)
                assert list(s.recv) == [_minimum(train, gen, specs, r, 2) for r in range(w)]
                if w <= 8 and not nested:  # the full plan agrees and covers every row once
                    plan = plan_reshard(train, gen, specs, "p2p", bucket_mb=0.01)
                    _coverage(plan, specs)
                    assert [plan.recv_bytes(r) for r in range(w)] == list(s.recv)
                if nested:
                    zr = summarize(train, gen, specs, "zero_redundancy", 2)
                    assert s.recv == zr.recv  # zero_redundancy is already minimal when nested
                    for other in ("allgather", "vanilla"):
                        assert max(s.recv) <= max(summarize(train, gen, specs, other, 2).recv)
                cases += 1
    assert cases > 150


def _run_local(shape, w, t, p, tg, pg, strategy, fmt_name, bucket_mb=0.01):
    tl = TrainLayout(w, tp=t, pp=p)
    hf = make_hf(shape)
    train = train_placement(tl, shape)
    nested = t % tg == 0 and p % pg == 0
    grouping = "vanilla" if strategy == "vanilla" else ("hybridflow" if nested else "consecutive")
    gen = gen_placement(tl, shape, tg, pg, grouping, vocab_pad=64 if fmt_name == "engine" else None)
    specs = build_specs(shape)
    plan = plan_reshard(train, gen, specs, strategy, bucket_mb=bucket_mb, itemsize=4)
    sources, asms = [], []
    for r in range(w):
        b, a, _ = train.coords[r]
        named = megatron_shards(shape, hf, t, b, p, a, train.vocab_chunk, pad_value=PAD)
        sources.append(train_sources(plan, r, named))
        asms.append(Assembler(plan, r, build_format(fmt_name, shape, gen, r)))
    run_plan_local(plan, sources, asms)
    out = []
    for r in range(w):
        gb, ga, _ = gen.coords[r]
        if fmt_name == "megatron":
            want = megatron_shards(shape, hf, tg, gb, pg, ga, gen.vocab_chunk)
        elif fmt_name == "engine":
            want = engine_shards(shape, hf, tg, gb, pg, ga, gen.vocab_chunk)
        else:
            want = {k: v for k, v in hf.items()}
        out.append(mismatches(asms[r].result(), want))
    return out


@pytest.mark.parametrize("tied, qkv_bias", [(False, False), (True, False), (False, True)])
def test_local_execution_matches_oracle_every_format(tied, qkv_bias):
    shape = LlamaShape(**{**SMALL.__dict__, "tied": tied, "qkv_bias": qkv_bias})
    cases = [(8, 2, 2, 1, 1), (8, 4, 2, 2, 2), (8, 2, 4, 1, 2), (8, 1, 1, 1, 1), (4, 2, 2, 2, 1)]
    for w, t, p, tg, pg in cases:
        for strategy in STRATEGIES:
            assert _run_local(shape, w, t, p, tg, pg, strategy, "megatron") == [[]] * w, (w, t, p, tg, pg, strategy)
        assert _run_local(shape, w, t, p, tg, pg, "zero_redundancy", "engine") == [[]] * w
    for w, t, p, tg, pg in [(8, 2, 1, 4, 1), (8, 1, 2, 8, 1), (8, 2, 2, 4, 2), (6, 3, 1, 2, 1)]:
        if shape.num_query_groups % t == 0:
            assert _run_local(shape, w, t, p, tg, pg, "p2p", "megatron") == [[]] * w, (w, t, p, tg, pg)
            assert _run_local(shape, w, t, p, tg, pg, "p2p", "engine") == [[]] * w, (w, t, p, tg, pg)
    assert _run_local(shape, 4, 2, 2, 1, 1, "p2p", "hf") == [[]] * 4


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_hf_roundtrip_and_engine_kv_error(qkv_bias):
    shape = LlamaShape(**{**SMALL.__dict__, "qkv_bias": qkv_bias})
    hf = make_hf(shape)
    canon = hf_to_canonical(shape, hf)
    fmt = hf_format(shape)
    back = {}
    for s in build_specs(shape):
        back.update(fmt(s, canon[s.key]))
    assert mismatches(back, hf) == []
    assert ("model.layers.0.self_attn.q_proj.bias" in back) == qkv_bias
    tl = TrainLayout(16, tp=1, pp=1)
    with pytest.raises(ValueError, match="num_query_groups=8"):
        gen_placement(tl, SMALL, 16, 1, "consecutive")
    with pytest.raises(ValueError, match="zero_redundancy"):
        plan_reshard(train_placement(TrainLayout(8, tp=2), SMALL),
                     gen_placement(TrainLayout(8, tp=2), SMALL, 4, 1, "consecutive"), build_specs(SMALL),
                     "zero_redundancy")
    assert torch.equal(canon["output_layer.weight"], hf["lm_head.weight"])


def test_p2p_consecutive_placement_balances_senders():
    """Non-nested gen layouts: no rank sends much more than it receives (llama2-70b shapes)."""
    from hybridrl.reshard.specs import PRESETS

    shape = PRESETS["llama2-70b"]
    specs = build_specs(shape)
    for w, t, p, tg, pg in [(1024, 2, 8, 8, 1), (256, 4, 4, 8, 2)]:
        tl = TrainLayout(w, tp=t, pp=p)
        s = summarize(train_placement(tl, shape), gen_placement(tl, shape, tg, pg, "consecutive"),
                      specs, "p2p")
        assert max(s.sent) <= 1.05 * max(s.recv), (w, t, p, tg, pg, max(s.sent), max(s.recv))
