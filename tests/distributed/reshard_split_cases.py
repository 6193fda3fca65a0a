"""Split-placement reshard cases, run inside test_reshard.py's 8-rank launch.

Each case puts a training layout on the first ranks and the generation layout on the others
(``split_placements``), runs the ``split`` plan with torch.distributed and returns, per rank,
what the test checks: the gen shard bit-identical to the oracle's slice of the full weights
(tests/unit/test_reshard_oracle.py), bytes moved equal to the plan's, training ranks receiving
nothing, and (``into``) the received tensors being the engine's own.
"""

SPLIT_CASES = [  # (train world, t, p, gen tp, gen pp, format)
    (4, 2, 2, 2, 1, "megatron"),   # pg != p
    (4, 1, 1, 4, 1, "megatron"),   # tg > t
    (6, 2, 1, 2, 1, "engine"),     # 3 DP replicas -> 1 gen replica, SGLang vocab padding
    (4, 2, 2, 1, 2, "megatron"),   # tg != t
    (2, 2, 1, 1, 1, "into"),       # 6 gen replicas, received in place
    (4, 4, 1, 2, 2, "megatron"),   # tg != t and pg != p
]


def split_case(rank, world, case):
    import torch
    import torch.distributed as dist

    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan, train_sources
    from hybridrl.reshard.formats import build_format
    from hybridrl.reshard.placement import split_placements
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import build_specs
    from tests.unit.test_reshard_oracle import (
        PAD,
        SMALL,
        engine_shards,
        make_hf,
        megatron_shards,
        mismatches,
    )

    tw, t, p, tg, pg, fmt = case
    train, gen = split_placements(TrainLayout(tw, tp=t, pp=p), SMALL, world - tw, tg, pg,
                                  vocab_pad=64 if fmt == "engine" else None)
    plan = plan_reshard(train, gen, build_specs(SMALL), "split", bucket_mb=0.02, itemsize=4)
    hf = make_hf(SMALL, seed=7 * tw + t)
    named, into, want = {}, None, {}
    if rank < tw:
        b, a, _ = train.coords[rank]
        named = megatron_shards(SMALL, hf, t, b, p, a, train.vocab_chunk, pad_value=PAD)
    else:
        gb, ga, _ = gen.coords[rank]
        cut = engine_shards if fmt == "engine" else megatron_shards
        want = cut(SMALL, hf, tg, gb, pg, ga, gen.vocab_chunk)
        if fmt == "into":  # stale values in the engine's tensors must vanish
            into = {k: torch.full_like(v, 7.0) for k, v in want.items()}
    fmt_fn = None if fmt == "into" or rank < tw else build_format(fmt, SMALL, gen, rank)
    asm = Assembler(plan, rank, fmt_fn, dtype=torch.float32, into=into)
    dist.barrier()
    stats = run_plan(plan, rank, train_sources(plan, rank, named), asm)
    got = asm.result()
    return {"bad": mismatches(got, want), "recv": (stats.bytes_received, plan.recv_bytes(rank)),
            "sent": (stats.bytes_sent, plan.sent_bytes(rank)),
            "in_place": into is None or all(got[k] is into[k] for k in into),
            "is_train": rank < tw}
