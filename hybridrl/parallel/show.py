"""Build every group of a layout on real ranks and print them (``torchrun ... -m hybridrl.parallel.show``).

Contract: run under torchrun (any world size; ``--ep`` / ``--etp`` add megatron's expert layout
and its ep / expt_tp / expt_dp columns); every rank builds the train and gen groups with
``build_groups``, hands the train groups to megatron-core, checks an all_reduce of its rank inside
each of its groups against the pure layout, and rank 0 prints one line per rank. Exit status 0 only
when every check passed on every rank; a bad layout exits 2 with one line on every rank.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from hybridrl.parallel.groups import build_groups, init_distributed
from hybridrl.parallel.layout import GenLayout, TrainLayout


def _check_sums(groups) -> list[str]:
    """Names of the groups whose all_reduce(rank) differs from the sum of their members."""
    bad = []
    for name, pg in groups.groups.items():
        t = torch.tensor([float(groups.rank)])
        dist.all_reduce(t, group=pg)
        if t.item() != sum(groups.members[name]):
            bad.append(name)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridrl.parallel.show")
    for flag in ("--tp", "--pp", "--gen-tp", "--gen-pp", "--ep"):
        ap.add_argument(flag, type=int, default=1)
    ap.add_argument("--etp", type=int, default=0, help="expert tp (0 = --tp)")
    ap.add_argument("--grouping", default="hybridflow")
    args = ap.parse_args(argv)
    init_distributed()
    try:
        train = TrainLayout(world=dist.get_world_size(), tp=args.tp, pp=args.pp, ep=args.ep,
                            etp=args.etp or None)
        gen = GenLayout(train, tp=args.gen_tp, pp=args.gen_pp, grouping=args.grouping)
    except ValueError as err:  # the same on every rank: all exit before any collective
        print(f"hybridrl.parallel.show: error: {err}", file=sys.stderr)
        return 2
    groups = build_groups(train, gen, timeout_s=120)
    from megatron.core import parallel_state as ps

    from hybridrl.parallel.megatron import apply_megatron_groups, clear_megatron_groups

    apply_megatron_groups(groups)
    megatron_view = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                     ps.get_data_parallel_rank(), ps.get_expert_model_parallel_rank(),
                     ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank())
    clear_megatron_groups()
    names = ("tp", "pp", "dp", "gen_tp", "gen_pp", "micro_dp") + (
        ("ep", "expt_tp", "expt_dp") if train.ep > 1 or train.etp != train.tp else ())
    row = {
        "rank": groups.rank,
        "groups": {n: list(groups.members[n]) for n in names},
        "ok": not _check_sums(groups)
        and megatron_view == (groups.tp_rank, groups.pp_rank, groups.dp_rank, groups.ep_rank,
                              groups.etp_rank, groups.index("expt_dp")),
    }
    rows: list = [None] * train.world
    dist.all_gather_object(rows, row)
    if groups.rank == 0:
        print(f"{train.world} ranks: train {train.pp}x{train.tp}x{train.dp} (p x t x d), "
              f"gen {gen.pp}x{gen.tp}x{gen.dg}x{train.dp} (pg x tg x dg x d)")
        print("rank | " + " | ".join(f"{n:<10}" for n in names) + " | all_reduce+megatron")
        for r in rows:
            cells = " | ".join(f"{str(r['groups'][n]):<10}" for n in names)
            print(f"{r['rank']:>4} | {cells} | {'ok' if r['ok'] else 'MISMATCH'}")
    ok = all(r["ok"] for r in rows)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
