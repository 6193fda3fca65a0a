"""Split placement hand-off: bytes per training rank per step, before and after issue 39.

    .venv/bin/python benchmarks/handoff_bytes.py [--prompts 1024] [--n 8] [--max-len 2048]

For ``--prompts`` x ``--n`` sequences with response lengths drawn from three distributions
(uniform 1..max, lognormal with median 400 or 1000 tokens and sigma 0.8, clipped to 1..max;
seed 0), cut over ``--gen-replicas`` generation replicas (``link.replica_rows``) and over the
training DP replicas by ``plan_rollout_partition`` (GRPO groups of n kept together, mini-batch
chunks of ``--mini`` prompts), it prints per training rank:
- before: what ``link.recv_shares`` received until issue 39 (every replica's rows as one float64
  tensor [rows, 1 + 3 R_replica] to every training rank, after a 32-byte header), computed from
  the lengths;
- after: ``link.handoff_bytes`` (every replica's 24-byte header and int32 lengths, then 8 bytes
  per valid token of the rank's own rows), the largest over the DP replicas;
and the ratio. ``handoff_bytes`` is the code's own count; tests/distributed/test_async_handoff.py
checks it equals what the wire carries (``rollout/handoff_bytes``) on 2 + 2 gloo ranks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hybridrl.rollout.partition import plan_rollout_partition  # noqa: E402
from hybridrl.rollout.split.link import handoff_bytes, replica_rows  # noqa: E402


def lengths(kind: str, n_seqs: int, max_len: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    if kind == "uniform":
        lens = torch.randint(1, max_len + 1, (n_seqs,), generator=g).float()
    else:
        median = float(kind.split("-")[1])
        lens = torch.exp(torch.randn(n_seqs, generator=g) * 0.8) * median
    return [int(v) for v in lens.round().clamp(1, max_len)]


def before_bytes(lens: list[int], n_replicas: int) -> int:
    """The former float64 message: every replica's rows x (1 + 3 x its longest response)."""
    total = 0
    for rows in replica_rows(len(lens), n_replicas):
        if rows:
            total += len(rows) * (1 + 3 * max(lens[i] for i in rows)) * 8
        total += 4 * 8
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--mini", type=int, default=256, help="ppo_mini_batch_size (prompts)")
    ap.add_argument("--gen-replicas", type=int, default=8)
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    n_seqs = args.prompts * args.n
    print(f"{args.prompts} prompts x {args.n} = {n_seqs} sequences, responses <= {args.max_len}, "
          f"{args.gen_replicas} generation replicas; bytes per training rank per step")
    print(f"{'lengths':>14} {'mean':>6} {'dp':>4} {'before MB':>10} {'after MB':>9} {'ratio':>7}")
    for kind in ("uniform", "lognormal-400", "lognormal-1000"):
        lens = lengths(kind, n_seqs, args.max_len)
        old = before_bytes(lens, args.gen_replicas)
        seq = [args.prompt_len + q for q in lens]
        for dp in args.dp:
            parts = plan_rollout_partition(seq, dp, args.mini * args.n, args.n)
            new = max(handoff_bytes(lens, mine, args.gen_replicas) for mine in parts)
            print(f"{kind:>14} {sum(lens) / n_seqs:>6.0f} {dp:>4} {old / 1e6:>10.1f} "
                  f"{new / 1e6:>9.2f} {old / new:>7.1f}")
    whole = n_seqs * (1 + 3 * args.max_len) * 8
    print(f"\nany response at the cap: before {whole / 1e6:.1f} MB per training rank (one replica "
          f"holding a {args.max_len}-token response pads all its rows to it)")


if __name__ == "__main__":
    main()
