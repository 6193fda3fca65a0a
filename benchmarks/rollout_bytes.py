"""Rollout-path bytes per rank per step: today's whole-batch all_gather vs the DP partition.

    .venv/bin/python benchmarks/rollout_bytes.py [--worlds 2 4 8] [--seqs 64] [--max-len 256]

On each world size (gloo ranks on CPU; training layout tp = pp = 1 so dp = world, gen tp 2, as
the engine's gen-TP sources hold the responses), every gen replica holds its share of ``--seqs``
sequences with random lengths up to ``--max-len``. In the same process group it runs:
- ``allgather``: the former whole-batch path (``RolloutWorker._gather`` until issue 39: a
  [rows, 1 + 3R] float64 tensor from every rank, zero rows from non-source ranks, after a size
  all_gather), bytes = what each rank received, computed from the lengths (the path is gone);
- ``partitioned``: ``exchange_rollouts`` of the rows ``plan_rollout_partition`` gives each DP
  rank (int32 ids + fp32 log-probs, point to point) plus the int32 length per sequence;
and prints, per world, the largest per-rank figure of each path, the rank's useful share, the
ratio, and ``rollout_bytes_model``'s prediction; then the model's figures at 256 ranks for the
DESIGN.md case (1024 prompts x n 8, 2k response tokens, train t 8 p 4 d 8, gen tp 4).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridrl.rollout.partition import rollout_bytes_model  # noqa: E402
from hybridrl.testing.dist import run_on_ranks  # noqa: E402

GEN_TP = 2


def _rank(rank: int, world: int, n_seqs: int, max_len: int) -> dict:
    import numpy as np
    import torch

    from hybridrl.rollout.base import GenerationOutput
    from hybridrl.rollout.partition import (
        exchange_rollouts,
        plan_rollout_partition,
        plan_transfers,
    )

    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, max_len + 1, (n_seqs,), generator=gen).tolist()
    shares = np.array_split(np.arange(n_seqs), world // GEN_TP)
    replica, is_src = rank // GEN_TP, rank % GEN_TP == 0
    rows = [int(i) for i in shares[replica]]
    R = max(lens[i] for i in rows)
    mask = (torch.arange(R)[None, :] < torch.tensor([lens[i] for i in rows])[:, None]).long()
    ids = torch.randint(0, 32000, (len(rows), R), generator=gen) * mask
    out = GenerationOutput(ids, mask, -torch.rand(len(rows), R, generator=gen) * mask)
    # before: every rank gathered every row (sizes, then the packed float64 rows)
    n_max = max(len(s) for s in shares)
    r_max = max(lens)
    old_bytes = world * 2 * 8 + world * n_max * (1 + 3 * r_max) * 8
    # new: each DP rank (dp = world here) receives its rows only
    parts = plan_rollout_partition(lens, world, n_seqs, 1)
    owner = [GEN_TP * rep for rep, share in enumerate(shares) for _ in share]
    transfers = plan_transfers(owner, parts, [[d] for d in range(world)])
    local, stats = exchange_rollouts(rank, transfers, parts[rank], rows if is_src else [],
                                     out, lens, 0, "cpu")
    assert local.response_mask.sum(-1).tolist() == [lens[i] for i in parts[rank]]  # its rows
    useful = sum(lens[i] for i in parts[rank]) * 8
    return {"allgather": old_bytes, "partitioned": stats.bytes_in + 4 * n_seqs,
            "useful": useful, "mean_len": sum(lens) / n_seqs, "r_max": r_max}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    args = ap.parse_args()
    print(f"{args.seqs} sequences, lengths 1..{args.max_len}, gen tp {GEN_TP}, dp = world")
    print(f"{'world':>5} {'allgather B':>13} {'partitioned B':>14} {'useful B':>10} "
          f"{'ratio':>7} {'model allgather':>16} {'model partitioned':>18}")
    for world in args.worlds:
        res = run_on_ranks(_rank, world, args.seqs, args.max_len, timeout=300)
        old = max(r["allgather"] for r in res)
        new = max(r["partitioned"] for r in res)
        useful = max(r["useful"] for r in res)
        m = rollout_bytes_model(args.seqs, res[0]["mean_len"], res[0]["r_max"], world, world,
                                GEN_TP)
        print(f"{world:>5} {old:>13,} {new:>14,} {useful:>10,} {old / new:>7.1f} "
              f"{m['allgather']:>16,.0f} {m['partitioned']:>18,.0f}")
    print("\nmodel at 256 ranks (1024 prompts x n 8, response <= 2048, t 8 p 4 d 8, gen tp 4):")
    for mean_len in (1024, 2048):
        m = rollout_bytes_model(8192, mean_len, 2048, world=256, dp=8, gen_tp=4)
        print(f"  mean response {mean_len}: allgather {m['allgather'] / 1e9:.2f} GB, partitioned "
              f"{m['partitioned'] / 1e6:.1f} MB (useful {m['useful'] / 1e6:.1f} MB), ratio "
              f"{m['allgather'] / m['partitioned']:.0f}x")


if __name__ == "__main__":
    main()
