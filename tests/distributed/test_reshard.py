"""8 gloo ranks, one process group: every train layout x every gen layout x every strategy.

For each case every rank starts from megatron training shards cut (by the independent oracle in
tests/unit/test_reshard_oracle.py) from seeded full HF weights, runs the plan with
torch.distributed, and checks: its gen shard is bit-identical to the oracle's slice of the full
weights (megatron format; the engine and HF formats on a subset), bytes it actually moved equal
the plan's, its peak live bytes stay within the plan's peak (gen shard + two buckets), and, on a
balanced model, zero_redundancy moves exactly (dg-1)/(t*p)*M per rank; split placements
(tests/distributed/reshard_split_cases.py: generation ranks apart) give bit-identical gen shards
with training ranks receiving nothing. Also: bf16, in-place
receive (``into=``), and ranks given different plans, or one rank given a bad input or a
wrongly shaped ``into=`` target, all raise instead of hanging.
"""

import itertools

import pytest

from hybridrl.testing.dist import run_on_ranks

WORLD = 8


def _div(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def _cases():
    out = []
    trains = [(t, p) for t, p in itertools.product(_div(WORLD), _div(WORLD)) if WORLD % (t * p) == 0]
    for t, p in trains:
        for tg, pg in itertools.product(_div(t), _div(p)):
            for strategy in ("allgather", "vanilla", "zero_redundancy", "p2p"):
                out.append((t, p, tg, pg, strategy, "megatron", "untied", False))
            out.append((t, p, tg, pg, "zero_redundancy", "megatron", "untied", True))  # Table 2
        for tg, pg in itertools.product(_div(WORLD), _div(WORLD)):
            if WORLD % (tg * pg) == 0 and (t % tg or p % pg):  # not nested: p2p only
                out.append((t, p, tg, pg, "p2p", "megatron", "untied", False))
    out += [(2, 2, 1, 1, s, "megatron", "tied", False) for s in ("zero_redundancy", "p2p", "allgather")]
    out += [(4, 2, 2, 2, "zero_redundancy", "engine", "untied", False),
            (2, 1, 4, 1, "p2p", "engine", "tied", False),
            (1, 2, 8, 1, "p2p", "engine", "untied", False),
            (2, 2, 1, 1, "zero_redundancy", "hf", "untied", False),
            (4, 2, 2, 1, "zero_redundancy", "into", "untied", False),
            (2, 2, 4, 1, "p2p", "into", "tied", False),
            (8, 1, 1, 1, "allgather", "hf", "tied", False)]
    out += [(2, 2, 1, 1, "zero_redundancy", "engine", "qkv_bias", False),
            (4, 2, 2, 1, "zero_redundancy", "megatron", "qkv_bias", False),
            (2, 1, 4, 1, "p2p", "engine", "qkv_bias", False)]
    out = [(*c, "fp32") for c in out]
    out += [(4, 2, 2, 1, "zero_redundancy", "engine", "untied", False, "bf16"),
            (2, 1, 4, 1, "p2p", "megatron", "untied", False, "bf16")]
    return out


def _setup(world, case):
    """(shape, specs, train placement, gen placement, plan) of one case (pure)."""
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.placement import gen_placement, train_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import LlamaShape, build_specs
    from tests.unit.test_reshard_oracle import SMALL, balanced

    t, p, tg, pg, strategy, fmt, variant, is_balanced, dtype = case
    if is_balanced:
        shape, specs = balanced(t, p, world // (t * p))
    else:
        shape = LlamaShape(**{**SMALL.__dict__, "tied": variant == "tied",
                              "qkv_bias": variant == "qkv_bias"})
        specs = build_specs(shape)
    tl = TrainLayout(world, tp=t, pp=p)
    train = train_placement(tl, shape)
    nested = t % tg == 0 and p % pg == 0
    grouping = "vanilla" if strategy == "vanilla" else ("hybridflow" if nested else "consecutive")
    gen = gen_placement(tl, shape, tg, pg, grouping, vocab_pad=64 if fmt == "engine" else None)
    return shape, specs, train, gen, plan_reshard(train, gen, specs, strategy, bucket_mb=0.02,
                                                  itemsize=2 if dtype == "bf16" else 4)


def _one_case(rank, world, case):
    import torch
    import torch.distributed as dist

    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan, train_sources
    from hybridrl.reshard.formats import build_format
    from tests.unit.test_reshard_oracle import (
        PAD,
        engine_shards,
        make_hf,
        megatron_shards,
        mismatches,
    )

    t, p, tg, pg, strategy, fmt, variant, is_balanced, dtype = case
    shape, specs, train, gen, plan = _setup(world, case)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    hf = make_hf(shape, seed=t * 100 + p, dtype=torch_dtype)
    b, a, _ = train.coords[rank]
    named = megatron_shards(shape, hf, t, b, p, a, train.vocab_chunk, pad_value=PAD)
    into = None
    if fmt == "into":  # receive straight into existing gen tensors (stale values must vanish)
        gb, ga, _ = gen.coords[rank]
        into = {k: torch.full_like(v, 7.0) for k, v in
                megatron_shards(shape, hf, tg, gb, pg, ga, gen.vocab_chunk).items()}
    fmt_fn = None if into is not None else build_format(fmt, shape, gen, rank)
    asm = Assembler(plan, rank, fmt_fn, dtype=torch_dtype, into=into)
    dist.barrier()
    stats = run_plan(plan, rank, train_sources(plan, rank, named), asm)
    got = asm.result()
    gb, ga, _ = gen.coords[rank]
    in_place = into is None or all(got[k] is into[k] for k in into)
    if fmt in ("megatron", "into"):
        want = megatron_shards(shape, hf, tg, gb, pg, ga, gen.vocab_chunk)
    elif fmt == "engine":
        want = engine_shards(shape, hf, tg, gb, pg, ga, gen.vocab_chunk)
    else:
        want = dict(hf)
    if is_balanced:
        want = {k: v for k, v in want.items() if "linear_" in k}
    model_bytes = sum(s.numel for s in specs if not s.tied_copy) * plan.itemsize
    return {
        "bad": mismatches(got, want),
        "recv": (stats.bytes_received, plan.recv_bytes(rank)),
        "sent": (stats.bytes_sent, plan.sent_bytes(rank)),
        "in_place": in_place,
        "peak_ok": stats.peak_live_bytes <= plan.peak_bytes(rank)
        and stats.peak_comm_bytes <= plan.transient_bytes(rank),
        "model_bytes": model_bytes,
        "dg": (t * p) // (tg * pg),
    }


def _mismatch(rank, world):
    """Ranks holding different plans, or one rank with a bad input: every rank raises."""
    from hybridrl.reshard.executor import check_same_plan

    strategy = "p2p" if rank == 3 else "zero_redundancy"
    plan = _setup(world, (2, 2, 1, 1, strategy, "megatron", "untied", False, "fp32"))[4]
    same = _setup(world, (2, 2, 1, 1, "p2p", "megatron", "untied", False, "fp32"))[4]
    out = []
    for args in ((plan, None, None), (same, None, "bad input" if rank == 5 else None)):
        try:
            check_same_plan(*args)
            out.append(None)
        except ValueError as err:
            out.append(str(err))
    out.append(_bad_into(rank, world))
    return out


def _bad_into(rank, world):
    """Rank 6's ``into=`` target has a wrong shape: every rank raises in run_plan, none hangs."""
    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan, train_sources
    from tests.unit.test_reshard_oracle import make_hf, megatron_shards

    case = (4, 2, 2, 1, "zero_redundancy", "into", "untied", False, "fp32")
    shape, _, train, gen, plan = _setup(world, case)
    hf = make_hf(shape, seed=1)
    b, a, _ = train.coords[rank]
    gb, ga, _ = gen.coords[rank]
    into = megatron_shards(shape, hf, 2, gb, 1, ga, gen.vocab_chunk)
    if rank == 6:
        name = next(iter(into))
        into[name] = into[name][:1]
    sources = train_sources(plan, rank, megatron_shards(shape, hf, 4, b, 2, a, train.vocab_chunk))
    try:
        run_plan(plan, rank, sources, Assembler(plan, rank, None, into=into))
    except ValueError as err:
        return str(err)
    return None


def _reshard_rank(rank, world, cases):
    from tests.distributed.reshard_split_cases import SPLIT_CASES, split_case

    return ([_one_case(rank, world, case) for case in cases], _mismatch(rank, world),
            [split_case(rank, world, case) for case in SPLIT_CASES])


@pytest.mark.slow
def test_reshard_8_ranks_every_layout_and_strategy():
    cases = _cases()
    out = run_on_ranks(_reshard_rank, WORLD, cases, timeout=600)
    per_rank = [r[0] for r in out]
    _check_split([r[2] for r in out])
    assert all(r[1][0] and "disagree on the reshard plan" in r[1][0] for r in out), out[0][1]
    assert all(r[1][1] == "group rank 5: bad input" for r in out), [r[1][1] for r in out]
    assert all(r[1][2] and r[1][2].startswith("group rank 6: rank 6: into[") and "expected shape"
               in r[1][2] for r in out), [r[1][2] for r in out]
    assert len(cases) > 150
    for i, case in enumerate(cases):
        t, p = case[0], case[1]
        for rank in range(WORLD):
            res = per_rank[rank][i]
            assert res["bad"] == [], (case, rank, res["bad"][:5])
            assert res["recv"][0] == res["recv"][1], (case, rank, res["recv"])
            assert res["sent"][0] == res["sent"][1], (case, rank, res["sent"])
            assert res["peak_ok"], (case, rank)
            assert res["in_place"], (case, rank)
            if case[7]:  # balanced zero_redundancy: Table 2
                want = (res["dg"] - 1) * res["model_bytes"] // (t * p)
                assert (res["dg"] - 1) * res["model_bytes"] % (t * p) == 0
                assert res["recv"][0] == want, (case, rank, res["recv"][0], want)


def _check_split(per_rank):
    """Split placement (gen ranks apart): bit-identical gen shards, bytes as planned."""
    from tests.distributed.reshard_split_cases import SPLIT_CASES

    for i, case in enumerate(SPLIT_CASES):
        for rank in range(WORLD):
            res = per_rank[rank][i]
            assert res["bad"] == [], (case, rank, res["bad"][:5])
            assert res["recv"][0] == res["recv"][1] and res["sent"][0] == res["sent"][1], (case, rank)
            assert res["in_place"], (case, rank)
            if res["is_train"]:
                assert res["recv"][0] == 0, (case, rank)
            else:
                assert res["sent"][0] == 0 and res["recv"][0] > 0, (case, rank)
