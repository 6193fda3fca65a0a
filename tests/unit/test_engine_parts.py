"""The builtin engine kept in training-shard parts, filled in place, in one process.

Every rank of a layout is played by ``run_plan_local``: the reshard writes into engines with
``blocks = engine_blocks(train, gen)`` parts (the rank's own parts aliased to its training
tensors), and the result is compared with engines in one part loaded the independent way
(``update_weights`` with the engine format). Odd vocabularies (parts holding only padding, a gen
chunk not divisible by gen tp), tied embeddings without ``lm_head``, Qwen2 q/k/v biases and
non-hybridflow groupings are the corners covered here; tests/distributed/test_engine_inplace.py
runs the same path on real gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.parallel.layout import TrainLayout
from hybridrl.reshard.assemble import Assembler
from hybridrl.reshard.executor import run_plan_local, train_sources
from hybridrl.reshard.formats import engine_format
from hybridrl.reshard.placement import gen_placement, train_placement
from hybridrl.reshard.planner import plan_reshard
from hybridrl.reshard.specs import LlamaShape, build_specs, storage_shape
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec
from hybridrl.rollout.worker import engine_blocks, inplace_targets

# vocab, train tp, train pp, gen tp, world, tied, strategy, grouping, q/k/v biases
CASES = [
    (17, 4, 1, 1, 4, False, "zero_redundancy", "hybridflow", False),  # padding-only parts
    (101, 2, 1, 1, 4, False, "zero_redundancy", "hybridflow", False),  # V odd: 101 % 2
    (17, 4, 1, 2, 4, True, "zero_redundancy", "hybridflow", False),  # tied, no lm_head
    (17, 4, 2, 1, 8, True, "zero_redundancy", "hybridflow", False),  # tied copy on stage 1
    (18, 4, 2, 2, 8, False, "p2p", "hybridflow", True),  # biases, tp > 1 embedding offsets
    (18, 4, 1, 2, 8, False, "p2p", "vanilla", False),
    (18, 2, 2, 1, 4, True, "p2p", "consecutive", False),
]


def _tensors(shape, specs, train, t, p, rank):
    b, a, _ = train.coords[rank]
    out = {}
    for s in specs:
        if s.on_stage(p, shape.layers, a):  # same values on every replica of a shard
            g = torch.Generator().manual_seed(1000 * b + sum(map(ord, s.name)))
            out[s.local_name(p, shape.layers)] = torch.randn(
                storage_shape(s, t, train.vocab_chunk), generator=g)
    return out


@pytest.mark.parametrize("V, t, p, tg, world, tied, strategy, grouping, bias", CASES)
def test_parts_filled_in_place_equal_the_engine_format_load(V, t, p, tg, world, tied, strategy,
                                                            grouping, bias):
    shape = LlamaShape(hidden=32, ffn=48, heads=8, num_query_groups=4, layers=4, vocab=V,
                       head_dim=4, make_vocab_size_divisible_by=8, tied=tied, qkv_bias=bias)
    layout = TrainLayout(world, tp=t, pp=p)
    train, specs = train_placement(layout, shape), build_specs(shape, "local")
    gen = gen_placement(layout, shape, tg, 1, grouping)
    plan = plan_reshard(train, gen, specs, strategy, bucket_mb=0.001, itemsize=4)
    blocks = engine_blocks(train, gen)
    assert blocks == t // tg
    named = [_tensors(shape, specs, train, t, p, r) for r in range(world)]
    sources = [train_sources(plan, r, named[r]) for r in range(world)]
    spec = EngineSpec(32, 48, 8, 4, 4, 4, V, gen.vocab_chunk, tie_word_embeddings=tied,
                      qkv_bias=bias)

    def engine(rank, k):
        return BuiltinEngine(spec, blocks=k, tp_size=tg, tp_rank=gen.coords[rank][0],
                             tp_group=object() if tg > 1 else None)

    parts = [engine(r, blocks) for r in range(world)]
    whole = [engine(r, 1) for r in range(world)]
    asms = [Assembler(plan, r, None, zero_padding=False,
                      into=inplace_targets(plan, r, named[r], parts[r], alias=True))
            for r in range(world)]
    assert [a.into_error for a in asms] == [None] * world
    run_plan_local(plan, sources, asms)
    run_plan_local(plan, sources, [Assembler(plan, r, engine_format(shape, gen, r),
                                             sink=whole[r].update_weights) for r in range(world)])
    for r in range(world):
        assert parts[r].missing_weights() == []
        real = max(0, min(gen.vocab_chunk, V - gen.coords[r][0] * gen.vocab_chunk))
        got, want = parts[r].weights, whole[r].weights
        for name, w in want.items():
            g = got[name]
            if "embed" in name or "lm_head" in name:  # padding rows are never read
                g, w = g[:real], w[:real]
            assert torch.equal(g, w), (r, name)
    if grouping == "hybridflow":  # every rank reads its own stage's shards in place
        assert all(any("#" in n for n in e.aliased) for e in parts)
    if tg == 1:
        params = SamplingParams(max_new_tokens=3, temperature=0.0)
        a = parts[0].generate([[1, 2, 3], [4]], params)
        b = whole[0].generate([[1, 2, 3], [4]], params)
        assert torch.equal(a.response_ids, b.response_ids)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
