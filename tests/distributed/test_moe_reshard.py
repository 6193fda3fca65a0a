"""4 gloo ranks, one launch: Qwen3-MoE weights resharded from megatron training shards at
(tp, ep, expert tp) into the engine layout at gen tp (issue 38 item 3), for 5 layouts.

Each rank starts from megatron tensors cut by the independent oracle of
tests/unit/test_moe_reshard.py out of seeded full HF tensors. Per layout:
- ``run_plan`` with torch.distributed into the engine format: every rank's tensors are
  bit-identical to the oracle's engine shards, and the bytes it received are the plan's;
- ``sync_engine`` in place into a builtin engine (training-TP parts, aliasing on): its stored
  weights are bit-identical to an engine loaded from the oracle's shards;
- the same with merged messages (``Coalescing``; training tensors in one flat buffer as
  megatron DDP keeps them): bit-identical, and where gen tp divides the expert tp (whole
  training tensors move) at most a quarter as many messages as transfers (a column slice of
  a training tensor is not contiguous: one message each);
- at gen tp 2, the engines generate (all-reduce over their gen-TP group): greedy tokens and
  top-k expert ids equal a one-process engine holding the whole model, log-probs within 1e-5.
"""

from __future__ import annotations

import torch

from hybridrl.testing.dist import run_on_ranks

WORLD = 4
LAYOUTS = [(1, 2, 1, 1), (2, 2, 2, 1), (2, 2, 1, 2), (1, 4, 1, 2), (2, 1, 2, 2)]  # tp ep etp tg
PROMPTS = [[3, 14, 15, 9], [26, 5]]


def _engine(shape, gen, rank, tp_group=None, blocks=1, whole=False):
    from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec

    spec = EngineSpec(shape.hidden, shape.ffn, shape.heads, shape.num_query_groups,
                      shape.head_dim, shape.layers, shape.vocab,
                      gen.vocab_chunk * (gen.tp if whole else 1), norm_eps=1e-6, qk_norm=True,
                      num_experts=shape.num_experts, moe_topk=shape.moe_topk,
                      moe_ffn_hidden_size=shape.moe_ffn_hidden_size)
    if whole:
        return BuiltinEngine(spec)
    return BuiltinEngine(spec, tp_group=tp_group, tp_rank=gen.coords[rank][0], tp_size=gen.tp,
                         tp_src=min(dist_ranks(gen, rank)), blocks=blocks)


def dist_ranks(gen, rank):
    rep = gen.coords[rank][2]
    return [gen.rank_at(b, 0, rep) for b in range(gen.tp)]


def _layout(rank, world, layout):
    import torch.distributed as dist

    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan, train_sources
    from hybridrl.reshard.formats import engine_format
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.engine_sync import sync_engine
    from hybridrl.rollout.worker import engine_blocks
    from tests.unit.test_moe_reshard import (
        MOE,
        make_moe_hf,
        moe_engine_shards,
        moe_setup,
        rank_shards,
    )

    tp, ep, etp, tg = layout
    hf = make_moe_hf(MOE, seed=7)
    train, gen, plan = moe_setup(world, tp, ep, etp, tg)
    named = rank_shards(MOE, hf, train, rank)
    gb = gen.coords[rank][0]
    want = moe_engine_shards(MOE, hf, tg, gb, gen.vocab_chunk)
    got = {}
    asm = Assembler(plan, rank, engine_format(MOE, gen, rank), sink=got.update)
    stats = run_plan(plan, train_sources(plan, named), asm)
    out = {"bad_format": sorted(k for k in want if k not in got or not torch.equal(got[k], want[k])),
           "extra": sorted(set(got) - set(want)),
           "received": (stats.bytes_received, plan.recv_bytes(rank))}
    groups = [dist.new_group(dist_ranks(gen, r)) for r in range(world)
              if gen.coords[r][0] == 0]  # every rank creates every gen-TP group, in order
    mine = groups[gen.coords[rank][2]] if tg > 1 else None
    engine = _engine(MOE, gen, rank, mine, engine_blocks(train, gen))
    sync_engine(plan, rank, MOE, {n: t.clone() for n, t in named.items()}, engine, torch.float32,
                alias=True)
    oracle = _engine(MOE, gen, rank, mine)
    oracle.update_weights(want.items())
    real = gen.interval(next(s for s in plan.specs if s.kind == "vocab"), rank)
    rows = real[1] - real[0]
    out["bad_inplace"] = sorted(
        n for n, w in oracle.weights.items()
        if not torch.equal(w[:rows] if n.endswith(("embed_tokens.weight", "lm_head.weight"))
                           else w, engine.weights[n][:rows] if n.endswith(
                               ("embed_tokens.weight", "lm_head.weight")) else engine.weights[n]))
    out["missing"] = engine.missing_weights()
    # merged messages: training tensors in one flat buffer (as megatron DDP's), agreed once,
    # then a second (replayed) sync; thousands of expert transfers become a few messages
    from hybridrl.rollout.engine_sync import Coalescing
    from tests.distributed.test_coalesce import _flat

    big = moe_setup(world, tp, ep, etp, tg, bucket_mb=64)[2]  # one bucket
    merged = _engine(MOE, gen, rank, mine, engine_blocks(train, gen))
    flat, coalescing = _flat(named), Coalescing()
    for _ in range(2):
        stats = sync_engine(big, rank, MOE, flat, merged, torch.float32, coalescing=coalescing)
    out["bad_merged"] = sorted(n for n, w in engine.weights.items()
                               if not torch.equal(w, merged.weights[n]))
    out["messages"] = stats.messages
    out["transfers"] = sum(1 for b in big.buckets for t in b if rank in (t.src, t.dst))
    if tg > 1:
        params = SamplingParams(max_new_tokens=5, temperature=0.0)
        res = engine.generate(PROMPTS, params)
        whole = _engine(MOE, gen, rank, whole=True)
        whole.update_weights(moe_engine_shards(MOE, hf, 1, 0, gen.vocab_chunk * tg).items())
        ref = whole.generate(PROMPTS, params)
        out["same_tokens"] = torch.equal(res.response_ids, ref.response_ids)
        out["same_routing"] = torch.equal(res.routed_experts, ref.routed_experts)
        out["logp_diff"] = float((res.logprobs - ref.logprobs).abs().max())
    return out


def _all_layouts(rank, world):
    return [_layout(rank, world, layout) for layout in LAYOUTS]


def test_moe_reshard_on_gloo_is_bit_identical_and_engines_generate_alike():
    results = run_on_ranks(_all_layouts, WORLD, timeout=600)
    for rank, per_layout in enumerate(results):
        for layout, out in zip(LAYOUTS, per_layout):
            where = f"rank {rank}, (tp, ep, etp, gen tp) = {layout}"
            assert out["bad_format"] == [] and out["extra"] == [], (where, out)
            assert out["received"][0] == out["received"][1], (where, out["received"])
            assert out["bad_inplace"] == [] and out["missing"] == [], (where, out)
            assert out["bad_merged"] == [], (where, out["bad_merged"][:3])
            if layout[2] % layout[3] == 0:  # gen tp | etp: whole training tensors move
                assert out["messages"] * 4 <= out["transfers"], (where, out)  # merged
            if layout[3] > 1:
                assert out["same_tokens"] and out["same_routing"], (where, out)
                assert out["logp_diff"] < 1e-5, (where, out)
