"""The ``hybridrl`` command line.

Contract: ``main(argv) -> int`` dispatches subcommands; bad arguments, or a ValueError raised by a
subcommand handler (hybridrl's type for bad user input), print ONE line ``hybridrl <cmd>: error: ...`` to stderr and return 2 (no traceback).

Subcommands:
- ``layout``: the training layout p x t x d in megatron order and the generation layout
  pg x tg x dg x d (HybridFlow or vanilla grouping): groups and per-rank shards, or ``--json``.
  ``--gen-world N`` (``parallel.placement=split``): both rank sets, the training layout on the
  first world - N ranks and the generation replicas (tg consecutive ranks each) on the last N.
- ``plan``: the reshard dry run (registered by ``hybridrl.planning.cli``).
- ``export``: a checkpoint's actor or critic as an HF folder (``hybridrl.checkpoint.export``).
- ``plot``: a PNG of a run's curves from its metrics.jsonl (``hybridrl.plot``, matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridrl.parallel.layout import GenLayout, TrainLayout, expert_lines, expert_summary

SHOW_RANKS_UP_TO = 16  # the human form lists every rank only for small worlds
SHOW_GROUPS = 4  # example groups printed per family


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)


def _sorted_groups(groups: list[list[int]]) -> list[list[int]]:
    return sorted(sorted(g) for g in groups)


def layout_json(train: TrainLayout, gen: GenLayout) -> dict:
    return {
        "world": train.world,
        "order": train.order,
        "train": {
            "tp_size": train.tp,
            "pp_size": train.pp,
            "dp_size": train.dp,
            "tp": _sorted_groups(train.groups("tp")),
            "pp": _sorted_groups(train.groups("pp")),
            "dp": _sorted_groups(train.groups("dp")),
        },
        "experts": expert_summary(train),
        "gen": {
            "tp_size": gen.tp,
            "pp_size": gen.pp,
            "dg": gen.dg,
            "grouping": gen.grouping,
            "tp": gen.tp_groups(),
            "pp": gen.pp_groups(),
            "micro_dp": gen.micro_dp_groups(),
            "dp": gen.dp_groups(),
        },
    }


def _fmt_groups(name: str, groups: list[list[int]]) -> str:
    shown = ", ".join(str(g) for g in groups[:SHOW_GROUPS])
    more = f", ... ({len(groups)} groups)" if len(groups) > SHOW_GROUPS else ""
    return f"  {name:<9} {shown}{more}"


def layout_text(train: TrainLayout, gen: GenLayout) -> str:
    t, p, d = train.tp, train.pp, train.dp
    lines = [
        f"world {train.world}: train p x t x d = {p} x {t} x {d}  (order {train.order})",
        f"         gen  pg x tg x dg x d = {gen.pp} x {gen.tp} x {gen.dg} x {d}"
        f"  (grouping {gen.grouping}, dg = p*t/(pg*tg) = {gen.dg})",
        "train groups:",
        _fmt_groups("tp", _sorted_groups(train.groups("tp"))),
        _fmt_groups("pp", _sorted_groups(train.groups("pp"))),
        _fmt_groups("dp", _sorted_groups(train.groups("dp"))),
        *(expert_lines(train) if train.ep > 1 or train.etp != train.tp else []),
        "gen groups:",
        _fmt_groups("tp", gen.tp_groups()),
        _fmt_groups("pp", gen.pp_groups()),
        _fmt_groups("micro_dp", gen.micro_dp_groups()),
    ]
    if train.world <= SHOW_RANKS_UP_TO:
        layers, cols = p * gen.pp, t * gen.tp  # a grid every stage and slice divides evenly
        lines.append(f"shards over {layers} layers x {cols} columns ([lo, hi) intervals):")
        lines.append("  rank  tp pp dp | train layers  cols   | gen layers  cols   tp pp mdp")
        for r in range(train.world):
            c, gc = train.coords(r), gen.coords(r)
            ts, gs = train.train_shard(r, layers, cols), gen.gen_shard(r, layers, cols)
            lines.append(
                f"  {r:>4}  {c['tp']:>2} {c['pp']:>2} {c['dp']:>2} | "
                f"[{ts.layer_lo},{ts.layer_hi})  [{ts.col_lo},{ts.col_hi})".ljust(40)
                + f"| [{gs.layer_lo},{gs.layer_hi})  [{gs.col_lo},{gs.col_hi})".ljust(22)
                + f"{gc.gen_tp:>2} {gc.gen_pp:>2} {gc.micro_dp:>3}"
            )
    return "\n".join(lines)


def split_layout_json(train: TrainLayout, gen_world: int, gen_tp: int) -> dict:
    first = train.world
    replicas = [list(range(first + i, first + i + gen_tp)) for i in range(0, gen_world, gen_tp)]
    return {"world": first + gen_world, "order": train.order, "placement": "split",
            "train_ranks": list(range(first)), "gen_ranks": list(range(first, first + gen_world)),
            "train": {"tp_size": train.tp, "pp_size": train.pp, "dp_size": train.dp,
                      "tp": _sorted_groups(train.groups("tp")),
                      "pp": _sorted_groups(train.groups("pp")),
                      "dp": _sorted_groups(train.groups("dp"))},
            "gen": {"tp_size": gen_tp, "pp_size": 1, "replicas": len(replicas), "tp": replicas}}


def split_layout_text(train: TrainLayout, gen_world: int, gen_tp: int) -> str:
    j = split_layout_json(train, gen_world, gen_tp)
    t, g = j["train_ranks"], j["gen_ranks"]
    return "\n".join([
        f"world {j['world']}: split placement, training ranks {t[0]}..{t[-1]}, generation ranks "
        f"{g[0]}..{g[-1]}",
        f"  train p x t x d = {train.pp} x {train.tp} x {train.dp} on {train.world} ranks "
        f"(order {train.order})",
        f"  gen   tg x replicas = {gen_tp} x {j['gen']['replicas']} on {gen_world} ranks "
        "(each replica tg consecutive ranks; weights arrive by the split reshard)",
        "train groups:",
        _fmt_groups("tp", j["train"]["tp"]),
        _fmt_groups("pp", j["train"]["pp"]),
        _fmt_groups("dp", j["train"]["dp"]),
        "gen groups:",
        _fmt_groups("tp", j["gen"]["tp"])])


def _cmd_layout(args: argparse.Namespace) -> int:
    if args.gen_world:
        try:
            if args.gen_world >= args.world or args.gen_world % args.gen_tp or args.gen_pp != 1:
                raise ValueError(f"--gen-world {args.gen_world} must be below --world {args.world}"
                                 f" and a multiple of --gen-tp {args.gen_tp} (gen pp 1)")
            train = TrainLayout(world=args.world - args.gen_world, tp=args.tp, pp=args.pp,
                                ep=args.ep, etp=args.etp or None)
        except ValueError as err:
            raise UsageError(str(err)) from None
        print(json.dumps(split_layout_json(train, args.gen_world, args.gen_tp)) if args.json
              else split_layout_text(train, args.gen_world, args.gen_tp))
        return 0
    try:
        train = TrainLayout(world=args.world, tp=args.tp, pp=args.pp, ep=args.ep,
                            etp=args.etp or None)
        gen = GenLayout(train, tp=args.gen_tp, pp=args.gen_pp, grouping=args.grouping)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.json:
        print(json.dumps(layout_json(train, gen)))
    else:
        print(layout_text(train, gen))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybridrl", description="3D-parallel RLHF with a zero-redundancy reshard")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    lay = sub.add_parser("layout", help="training and generation layouts of a world")
    lay.add_argument("--world", type=int, required=True, help="number of ranks (GPUs)")
    lay.add_argument("--tp", type=int, default=1, help="training tensor-parallel size t")
    lay.add_argument("--pp", type=int, default=1, help="training pipeline-parallel size p")
    lay.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    lay.add_argument("--etp", type=int, default=0, help="expert tensor-parallel size (0 = --tp)")
    lay.add_argument("--gen-tp", type=int, default=1, help="generation tensor-parallel size tg")
    lay.add_argument("--gen-pp", type=int, default=1, help="generation pipeline-parallel size pg")
    lay.add_argument("--grouping", choices=["hybridflow", "vanilla"], default="hybridflow")
    lay.add_argument("--gen-world", type=int, default=0,
                     help="split placement: the last N ranks generate (0 = colocated)")
    lay.add_argument("--json", action="store_true", help="print one JSON object")
    lay.set_defaults(func=_cmd_layout)
    from hybridrl.planning.cli import add_parser as add_plan_parser

    add_plan_parser(sub)
    from hybridrl.checkpoint.export import add_parser as add_export_parser

    add_export_parser(sub)
    from hybridrl.plot import add_parser as add_plot_parser

    add_plot_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = f"hybridrl {argv[0]}" if argv and not argv[0].startswith("-") else "hybridrl"
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except (UsageError, ValueError) as err:  # ValueError: hybridrl's type for bad user input
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
