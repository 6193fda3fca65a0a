"""A reshard given a wrong description fails on every rank with one line, sends nothing, never hangs.

4 gloo ranks, one launch, training layout tp 2 x pp 2 of a small llama (vocab 300 padded with
megatron's divisor 128: 256 rows per TP rank). The training tensors are the independent
oracle's megatron shards (tests/unit/test_reshard_oracle.py) of that model; each case describes
the model wrongly or passes a wrong argument, and every rank must raise the same ValueError
line (naming the tensor and both shapes where a shape is wrong) from ``run_plan``'s agreement,
with no isend/irecv posted:

- shape descriptions: vocab divisor 100 instead of 128 (used to run "ok" with the embedding and
  output rows shifted), ffn 64 instead of 48 and 4 KV groups instead of 8 (used to be a torch
  error on some ranks after p2p ops were posted, the others hanging), 2 layers per stage instead
  of 4 and 8 instead of 4;
- arguments: every rank passing rank=0, one rank passing another's rank, assemblers built for
  rank 0, a plan for 2 ranks on a 4-rank group, hand-built sources lacking a key;
- and the defaults on a correct description (rank from the group, ``gen_placement``'s default
  grouping, ``plan_reshard``'s ``strategy="auto"``), nested (zero_redundancy) and not (gen tp 4:
  optimal grouping, p2p): bit-identical to the oracle's gen shards.
"""

import dataclasses

from hybridrl.testing.dist import run_on_ranks

WORLD = 4
MISUSES = {  # case -> the line every rank raises (the group rank that reported it first)
    "vocab_divisor": "group rank 0: training tensor 'embedding.word_embeddings.weight' has shape "
                     "(256, 32) but the reshard's shape description gives (200, 32) (200 = the "
                     "vocabulary's rows per TP rank: check vocab and make_vocab_size_divisible_by)",
    "ffn": "group rank 0: training tensor 'decoder.layers.0.mlp.linear_fc1.weight' has shape "
           "(48, 32) but the reshard's shape description gives (64, 32) (check ffn and hidden)",
    "kv_groups": "group rank 0: training tensor 'decoder.layers.0.self_attention.linear_qkv.weight'"
                 " has shape (64, 32) but the reshard's shape description gives (48, 32) (check "
                 "num_query_groups, heads, head_dim and hidden)",
    "fewer_layers": "group rank 0: training tensor 'decoder.layers.2.input_layernorm.weight' is "
                    "layer 2 of its stage but the reshard's shape description gives 2 layers per "
                    "stage (layers=4, pp=2): check layers",
    "more_layers": "group rank 0: missing training tensor 'decoder.layers.4.input_layernorm."
                   "weight' (the model has no tensor of this name on this rank's stage: check the "
                   "shape description and naming)",
    "rank_all_zero": "group rank 1: rank=0 was passed but this process is rank 1 of the process "
                     "group (4 ranks); leave rank= out to use the group's rank",
    "rank_one_wrong": "group rank 2: rank=3 was passed but this process is rank 2 of the process "
                      "group (4 ranks); leave rank= out to use the group's rank",
    "assembler_rank": "group rank 1: the assembler was built for rank 0 but this process runs "
                      "rank 1",
    "plan_world": "group rank 0: the plan is for 2 ranks but the process group has 4",
    "hand_sources": "group rank 3: sources lack 'decoder.final_layernorm.weight' (rows 0..32 of "
                    "it are on this rank)",
}


def _true_shape():
    from hybridrl.reshard.specs import LlamaShape

    return LlamaShape(hidden=32, ffn=48, heads=16, num_query_groups=8, layers=8, vocab=300,
                      head_dim=4, make_vocab_size_divisible_by=128)


def _misuse(rank, world, case, named):
    """Run one misused reshard on this rank (raises ValueError when the case is caught)."""
    import torch

    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan, train_sources
    from hybridrl.reshard.formats import megatron_format
    from hybridrl.reshard.placement import gen_placement, train_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import build_specs

    wrong = {"vocab_divisor": {"make_vocab_size_divisible_by": 100}, "ffn": {"ffn": 64},
             "kv_groups": {"num_query_groups": 4}, "fewer_layers": {"layers": 4},
             "more_layers": {"layers": 16}}
    shape = dataclasses.replace(_true_shape(), **wrong.get(case, {}))
    layout = TrainLayout(2, tp=2) if case == "plan_world" else TrainLayout(world, tp=2, pp=2)
    gen = gen_placement(layout, shape, 1, 1, "hybridflow")
    plan = plan_reshard(train_placement(layout, shape), gen, build_specs(shape),
                        "zero_redundancy", bucket_mb=0.01, itemsize=4)
    as_rank = {"rank_all_zero": 0, "rank_one_wrong": 3 if rank == 2 else rank}.get(case, rank)
    asm = Assembler(plan, 0 if case == "assembler_rank" else as_rank,
                    megatron_format(gen, as_rank), dtype=torch.float32)
    sources = train_sources(plan, as_rank, named)
    if case == "hand_sources":
        sources = {k: v for k, v in sources.items()
                   if not (rank == 3 and k == "decoder.final_layernorm.weight")}
    if case == "assembler_rank":  # rank left to the group
        return run_plan(plan, sources, asm)
    return run_plan(plan, as_rank, sources, asm)


def _defaults(rank, world, named, hf, gen_tp):
    """A correct reshard with every default: no rank=, default grouping, strategy auto."""
    import torch

    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan, train_sources
    from hybridrl.reshard.formats import megatron_format
    from hybridrl.reshard.placement import gen_placement, train_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import build_specs
    from tests.unit.test_reshard_oracle import megatron_shards, mismatches

    shape = _true_shape()
    layout = TrainLayout(world, tp=2, pp=2)
    gen = gen_placement(layout, shape, gen_tp)
    plan = plan_reshard(train_placement(layout, shape), gen, build_specs(shape), bucket_mb=0.01,
                        itemsize=4)
    asm = Assembler(plan, rank, megatron_format(gen, rank), dtype=torch.float32)
    stats = run_plan(plan, train_sources(plan, named), asm)
    gb, ga, _ = gen.coords[rank]
    want = megatron_shards(shape, hf, gen_tp, gb, 1, ga, gen.vocab_chunk)
    return (plan.strategy, gen.grouping, mismatches(asm.result(), want),
            stats.bytes_received == plan.recv_bytes(rank))


def _misuse_rank(rank, world):
    import torch.distributed as dist

    from tests.unit.test_reshard_oracle import make_hf, megatron_shards

    shape = _true_shape()
    hf = make_hf(shape, seed=3)
    b, a = rank % 2, rank // 2  # TrainLayout(4, tp=2, pp=2): tp fastest, then pp
    named = megatron_shards(shape, hf, 2, b, 2, a, shape.padded_vocab(2) // 2, pad_value=999.0)
    posted, post = [], dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: posted.append(len(ops)) or post(ops)
    out = {}
    try:
        for case in MISUSES:
            before = len(posted)
            try:
                _misuse(rank, world, case, named)
                out[case] = ("no error", None, len(posted) - before)
            except Exception as err:  # noqa: BLE001  (any other kind is a failure, reported)
                out[case] = (type(err).__name__, str(err).splitlines()[0], len(posted) - before)
            dist.barrier()
        before = len(posted)
        out["defaults"] = [_defaults(rank, world, named, hf, tg) for tg in (1, 4)]
        out["defaults_posted"] = len(posted) - before
    finally:
        dist.batch_isend_irecv = post
    return out


def test_reshard_misuse_fails_on_every_rank_with_one_line():
    per_rank = run_on_ranks(_misuse_rank, WORLD, timeout=180)
    for case, line in MISUSES.items():
        got = [r[case] for r in per_rank]
        assert all(g == ("ValueError", line, 0) for g in got), (case, got)
    for rank, r in enumerate(per_rank):
        assert r["defaults"] == [("zero_redundancy", "hybridflow", [], True),
                                 ("p2p", "optimal", [], True)], (rank, r["defaults"])
        assert r["defaults_posted"] > 0
