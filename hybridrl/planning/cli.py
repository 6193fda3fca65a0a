"""``hybridrl plan``: dry run of the train -> gen reshard, per strategy, for any world size.

Contract:
- ``add_parser(subparsers)`` registers the ``plan`` subcommand (the lead's hybridrl/cli.py calls
  it); its handler ``args.func(args) -> int`` prints a table, or one JSON object with ``--json``:
  ``{"model_bytes": M, "strategies": {"allgather": {...}, "vanilla": {...},
  "zero_redundancy": {...}, "p2p": {...}}, ...}``; each strategy has
  ``max_bytes_received_per_rank``, ``max_bytes_sent_per_rank``, ``max_peak_bytes_per_rank``,
  ``est_seconds`` (max bytes in or out of a rank over ``--gbps``) and ``table2_bytes_received``,
  or only a ``"reason"`` when it does not apply to the layout.
- ``--model`` is a preset (``reshard.specs.PRESETS``: llama-3.1-8b/70b, qwen2.5-7b/72b,
  qwen3-8b/32b, llama2-7b/13b/34b/70b; the old llama-7b... names are refused naming the new
  ones), an HF folder or its config.json of any supported architecture; ``--memory --config``
  without ``--model`` plans the config's own ``model.path`` (``model_of_config``).
- ``--gen-world N`` plans the split placement instead (``hybridrl.planning.split``: both rank
  sets, bytes received per generation rank and sent per training rank, the send balance, and
  the sync's seconds at each ``--link-gbps`` speed, a comma list: ``link_speeds``).
- ``--memory`` prints the per-GPU memory plan instead (``memory_report``: bytes by phase, the
  verdict; ``hybridrl.planning.memory``), or its JSON with ``--json``.
- ``--time`` / ``--search`` / ``--calibrate``: the predicted seconds of a step, the best
  layouts by it, the CPU calibration (``hybridrl.planning.timecli``; docs/scaling.md).
- Bad input raises ValueError (the top-level CLI prints one line and exits 2). ``main(argv)``
  runs the subcommand standalone with the same behaviour (tests call it in-process).
- Costs come from ``summarize`` (no per-element enumeration): 1024 ranks answer in about a second.
  Bytes are those of the point-to-point send / receive buffers every strategy posts. The gen
  placement pads the vocab to ``--vocab-pad`` (default: the engine's padding as the trainer's
  reshard uses it, 64 for SGLang, megatron's padded training vocab with ``--engine builtin``);
  ``--vocab-pad 0`` keeps megatron's padded training vocab.
- The gen placement is the one the trainer uses (``default_gen_placement``: HybridFlow grouping
  when tg | t and pg | p, else the placement-optimal one). ``gen.replicas`` lists each gen
  replica's ranks in (gen_pp, gen_tp) order (the text shows the first few); when the grouping is
  ``optimal``, ``gen.consecutive_p2p_max_bytes_received_per_rank`` is what the plain
  rank-order grouping would receive, for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from hybridrl.parallel.layout import TrainLayout
from hybridrl.reshard.placement import (
    ENGINE_VOCAB_PAD,
    default_gen_placement,
    gen_placement,
    train_placement,
)
from hybridrl.reshard.planner import STRATEGIES, zero_redundancy_reason
from hybridrl.reshard.specs import (
    PRESETS,
    RENAMED_PRESETS,
    LlamaShape,
    build_specs,
    preset,
    preset_of_folder,
)
from hybridrl.reshard.summary import summarize, table2

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def load_shape(model: str) -> LlamaShape:
    """A preset name, an HF model folder or its config.json (Llama 2/3.x, Qwen2/2.5, Qwen3;
    anything else is refused naming the config key)."""
    if model in PRESETS or model in RENAMED_PRESETS:
        return preset(model)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"--model must be a preset ({', '.join(PRESETS)}), a model folder or "
                         f"a config.json path, got {model!r}")
    with open(path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err})") from None
    return LlamaShape.from_hf_config(cfg, source=path)


def plan_report(args: argparse.Namespace) -> dict:
    """The JSON report of ``hybridrl plan`` (pure: no process group)."""
    shape = load_shape(args.model)
    layout = TrainLayout(world=args.world, tp=args.tp, pp=args.pp, ep=args.ep,
                         etp=args.etp or None)
    train = train_placement(layout, shape)
    itemsize = DTYPE_BYTES[args.dtype]
    specs = build_specs(shape)
    model_bytes = shape.num_params() * itemsize
    if not args.gbps > 0 or not args.bucket_mb > 0:
        raise ValueError(f"--gbps and --bucket-mb must be > 0, got {args.gbps}, {args.bucket_mb}")
    if args.vocab_pad is None:  # the engine's own padding: SGLang's 64, the builtin's training one
        args.vocab_pad = 0 if getattr(args, "engine", "sglang") == "builtin" else ENGINE_VOCAB_PAD
    if args.vocab_pad < 0:
        raise ValueError(f"--vocab-pad must be >= 0, got {args.vocab_pad}")
    vocab_pad = args.vocab_pad or None  # 0: megatron's padded training vocab
    nested_gen = default_gen_placement(layout, shape, args.gen_tp, args.gen_pp, vocab_pad)
    dg = (args.tp * args.pp) // (args.gen_tp * args.gen_pp) if nested_gen.grouping == "hybridflow" else None
    out = {"model": args.model, "model_bytes": model_bytes, "dtype": args.dtype,
           "world": args.world, "train": {"tp": args.tp, "pp": args.pp, "dp": layout.dp},
           "gen": {"tp": args.gen_tp, "pp": args.gen_pp, "dg": dg, "grouping": nested_gen.grouping,
                   "replicas": _replicas(nested_gen)},
           "bucket_mb": args.bucket_mb, "gbps": args.gbps, "strategies": {}}
    for strategy in STRATEGIES:
        gen = nested_gen
        if strategy == "zero_redundancy" and (why := zero_redundancy_reason(train, gen)):
            out["strategies"][strategy] = {"reason": why}
            continue
        if strategy == "vanilla" and gen.grouping == "hybridflow":
            gen = gen_placement(layout, shape, args.gen_tp, args.gen_pp, "vanilla",
                                vocab_pad)
        s = summarize(train, gen, specs, strategy, itemsize, int(args.bucket_mb * (1 << 20)))
        entry = s.as_dict()
        entry["est_seconds"] = max(max(s.recv), max(s.sent)) * 8 / (args.gbps * 1e9)
        if dg is not None:
            entry["table2_bytes_received"] = float(
                table2(strategy, args.tp, args.pp, layout.dp, dg, model_bytes))
        out["strategies"][strategy] = entry
    if nested_gen.grouping == "optimal":
        plain = gen_placement(layout, shape, args.gen_tp, args.gen_pp, "consecutive", vocab_pad)
        out["gen"]["consecutive_p2p_max_bytes_received_per_rank"] = max(
            summarize(train, plain, specs, "p2p", itemsize).recv)
    return out


def _replicas(gen) -> list[list[int]]:
    """Each gen replica's ranks in (gen_pp, gen_tp) order."""
    n = gen.world // (gen.tp * gen.pp)
    return [[gen.rank_at(b, a, rep) for a in range(gen.pp) for b in range(gen.tp)]
            for rep in range(n)]


def _text(rep: dict) -> str:
    g, t = rep["gen"], rep["train"]
    lines = [
        f"{rep['model']}: M = {rep['model_bytes'] / 1e9:.2f} GB ({rep['dtype']}), world "
        f"{rep['world']}: train p x t x d = {t['pp']} x {t['tp']} x {t['dp']}, gen pg x tg = "
        f"{g['pp']} x {g['tp']} (grouping {g['grouping']}, dg = {g['dg']})",
        f"{'strategy':<16} {'recv/rank GB':>12} {'sent/rank GB':>12} {'peak/rank GB':>12} "
        f"{'est s @' + str(rep['gbps']) + 'Gb/s':>16}",
    ]
    reps = g["replicas"]
    shown = ", ".join(str(r) for r in reps[:4]) + (f", ... ({len(reps)} in all)" if len(reps) > 4
                                                    else "")
    head = [f"gen replicas, ranks in (gen_pp, gen_tp) order: {shown}"]
    if "consecutive_p2p_max_bytes_received_per_rank" in g:
        head.append(f"placement-optimal: p2p with the consecutive grouping would receive "
                    f"{g['consecutive_p2p_max_bytes_received_per_rank'] / 1e9:.3f} GB/rank")
    lines[1:1] = head
    for name, e in rep["strategies"].items():
        if "reason" in e:
            lines.append(f"{name:<16} n/a: {e['reason']}")
            continue
        lines.append(
            f"{name:<16} {e['max_bytes_received_per_rank'] / 1e9:>12.3f} "
            f"{e['max_bytes_sent_per_rank'] / 1e9:>12.3f} {e['max_peak_bytes_per_rank'] / 1e9:>12.3f} "
            f"{e['est_seconds']:>16.3f}")
    return "\n".join(lines)


def model_of_config(cfg) -> str:
    """What ``--model`` a run config names: its ``model.path`` when that folder has a
    config.json here, else the preset its folder name stands for (``.../Llama-3.1-70B-Instruct``
    -> ``llama-3.1-70b``); ValueError when neither."""
    path = cfg.model.path
    if path and os.path.isfile(os.path.join(path, "config.json")):
        return path
    name = preset_of_folder(path) if path else None
    if name is None:
        raise ValueError(f"--config's model.path={path!r} has no config.json here and names no "
                         f"preset ({', '.join(PRESETS)}): pass --model")
    return name


def memory_report(args: argparse.Namespace, cache: dict | None = None) -> dict:
    """``hybridrl plan --memory``: the per-GPU memory plan (``hybridrl.planning.memory``), with
    the reshard's transient (its buckets in flight beyond the engine's weights, which it fills)
    from the auto strategy (zero_redundancy when the shards nest); ``cache`` (a dict) keeps the
    reshard terms of layouts already planned (``plan --search``)."""
    from hybridrl.planning.memory import MemoryJob, plan_memory
    from hybridrl.planning.report import job_from_config, padding_line

    cfg = None
    if args.config:  # the layouts and knobs of a run config; the model: --model or its own
        from hybridrl.config import load_config

        cfg = load_config([args.config])
        args.model = args.model or model_of_config(cfg)
        args.bucket_mb = cfg.reshard.bucket_mb  # the run's reshard buckets
        if args.world is None:  # the config's own layout: tp * pp * dp
            p = cfg.parallel
            if not p.dp:
                raise ValueError("--world is required when the config's parallel.dp is 0")
            args.world = p.tp * p.pp * p.dp
    shape = load_shape(args.model)
    if args.world is None:
        raise ValueError("--world is required (or --memory --config with parallel.dp)")
    if args.gpu_gb is None:
        args.gpu_gb = 80.0
    if cfg is not None:
        extra = {} if args.mem_fraction_static is None else \
            {"mem_fraction_static": args.mem_fraction_static}
        job = job_from_config(cfg, shape, args.world, args.gpu_gb, spec=args.spec, **extra)
        args.tp, args.pp, args.gen_tp, args.gen_pp = job.tp, job.pp, job.gen_tp, job.gen_pp
        args.ep, args.etp = job.ep, job.etp
        args.dtype, args.engine = job.dtype, job.engine
    else:
        if args.gen_tp is None:
            raise ValueError("--gen-tp is required (or --config)")
        parts = [p for p in args.offload.split(",") if p] if args.offload else []
        job = MemoryJob(
            shape=shape, world=args.world, tp=args.tp, pp=args.pp,
            gen_tp=args.gen_tp, gen_pp=args.gen_pp, dtype=args.dtype,
            max_tokens_per_gpu=args.max_tokens_per_gpu, seq_len=args.seq_len,
            recompute=args.recompute, sequence_parallel=args.sp, critic=not args.no_critic,
            ref=not args.no_ref, dist_opt=not args.no_dist_opt, offload=frozenset(parts),
            rollout_seqs=args.rollout_seqs, gpu_gb=args.gpu_gb, spec=args.spec,
            engine=args.engine, mem_fraction_static=args.mem_fraction_static or 0.5,
            ep=args.ep, etp=args.etp,
            forward_tokens_per_gpu=getattr(args, "forward_tokens_per_gpu", 0))
    key = (args.model, args.world, args.tp, args.pp, args.gen_tp, args.gen_pp, args.dtype,
           args.engine, args.bucket_mb, args.vocab_pad, args.gpus_per_node, args.ep, args.etp)
    if getattr(args, "placement", "colocated") == "split":  # the training ranks of a split
        transient, traffic = 0, {}  # placement: no engine, no colocated reshard on them
    elif cache is not None and key in cache:
        transient, traffic = cache[key]
    else:
        transient, traffic = _reshard_terms(args, shape)
        if cache is not None:
            cache[key] = transient, traffic
    job = dataclasses.replace(job, reshard_bytes=transient)
    knobs = {k: v for k, v in dataclasses.asdict(job).items() if k != "shape"}
    knobs["offload"] = sorted(job.offload)
    padding = {} if cfg is None else {"padding": padding_line(cfg, job.dp)}
    return {"model": args.model, "world": args.world, "tp": args.tp, "pp": args.pp,
            "gen_tp": args.gen_tp, "gen_pp": args.gen_pp, "job": knobs, **plan_memory(job),
            **({"reshard_traffic": traffic} if traffic else {}), **padding}


def _reshard_terms(args: argparse.Namespace, shape: LlamaShape) -> tuple[int, dict]:
    """The auto strategy's (zero_redundancy when the shards nest, else p2p) transient bytes on
    the worst rank (its buckets in flight beyond the engine's weights), and where its bytes
    travel (``hybridrl.planning.traffic``)."""
    from hybridrl.planning.traffic import reshard_traffic

    if not args.bucket_mb > 0:
        raise ValueError(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    if args.vocab_pad is None:  # the engine's own padding, as plan_report has it
        args.vocab_pad = 0 if args.engine == "builtin" else ENGINE_VOCAB_PAD
    layout = TrainLayout(world=args.world, tp=args.tp, pp=args.pp,
                         ep=getattr(args, "ep", 1), etp=getattr(args, "etp", 0) or None)
    train, specs = train_placement(layout, shape), build_specs(shape)
    gen = default_gen_placement(layout, shape, args.gen_tp, args.gen_pp, args.vocab_pad or None)
    strategy = "p2p" if zero_redundancy_reason(train, gen) else "zero_redundancy"
    itemsize = DTYPE_BYTES[args.dtype]
    summary = summarize(train, gen, specs, strategy, itemsize, int(args.bucket_mb * (1 << 20)))
    traffic = reshard_traffic(train, gen, specs, strategy, itemsize, args.gpus_per_node)
    return int(summary.as_dict()["max_transient_bytes_per_rank"]), {"strategy": strategy,
                                                                    **traffic}


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.time or args.search or args.calibrate:  # the step-time model (planning.timecli)
        from hybridrl.planning.timecli import run

        if sum((args.time, args.search, args.calibrate, args.memory)) > 1:
            raise ValueError("pick one of --time, --search, --calibrate, --memory")
        return run(args)
    if args.config and not args.memory:
        raise ValueError("--config goes with --memory")
    if args.model is None and not args.config:
        raise ValueError("--model is required (a preset, a model folder or a config.json), "
                         "unless --memory --config names the model (model.path)")
    if not args.memory and args.gen_tp is None:
        raise ValueError("--gen-tp is required")
    if not args.memory and args.world is None:
        raise ValueError("--world is required")
    if args.gen_world and not args.memory:  # split placement (hybridrl/planning/split.py)
        from hybridrl.planning.split import split_report, split_text

        pad = args.vocab_pad if args.vocab_pad is not None else (
            0 if args.engine == "builtin" else ENGINE_VOCAB_PAD)
        rep = split_report(load_shape(args.model), args.world, args.tp, args.pp, args.gen_world,
                           args.gen_tp, DTYPE_BYTES[args.dtype], args.bucket_mb, args.gbps,
                           pad or None, link_speeds(args.link_gbps), ep=args.ep, etp=args.etp)
        print(json.dumps(rep) if args.json else split_text(rep, args.model, args.gbps))
        return 0
    if args.memory:
        from hybridrl.planning.report import format_report

        rep = memory_report(args)
        j = rep["job"]
        title = (f"{args.model}: world {args.world}, train p x t x d = {args.pp} x {args.tp} x "
                 f"{rep['dp']}, gen pg x tg = {args.gen_pp} x {args.gen_tp}, {j['dtype']}, "
                 f"{j['max_tokens_per_gpu']} tokens/micro-batch, recompute {j['recompute']}"
                 f"{', sp' if j['sequence_parallel'] else ''}"
                 f"{', offload ' + ','.join(j['offload']) if j['offload'] else ''}")
        print(json.dumps(rep) if args.json else format_report(rep, title))
        return 0
    rep = plan_report(args)
    print(json.dumps(rep) if args.json else _text(rep))
    return 0


LINKS = "25,50,100,200,400"


def link_speeds(text: str) -> tuple[float, ...]:
    """``--link-gbps``: comma-separated positive Gbit/s (ValueError naming the flag)."""
    try:
        speeds = tuple(float(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        speeds = ()
    if not speeds or not all(g > 0 for g in speeds):
        raise ValueError(f"--link-gbps must be positive Gbit/s separated by commas, got {text!r}")
    return speeds


def _fill(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model",
                   help=f"a preset ({', '.join(PRESETS)}), an HF model folder or its "
                        "config.json (Llama 2/3.x, Qwen2/2.5, Qwen3); with --memory --config: "
                        "default the config's model.path (or the preset its folder name is)")
    p.add_argument("--world", type=int, help="number of ranks (GPUs); with --memory --config: "
                   "default the config's tp * pp * dp")
    p.add_argument("--tp", type=int, default=1, help="training tensor-parallel size t")
    p.add_argument("--pp", type=int, default=1, help="training pipeline-parallel size p")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--etp", type=int, default=0, help="expert tensor-parallel size (0 = --tp)")
    p.add_argument("--gen-tp", type=int, help="generation tensor-parallel size tg (required "
                   "unless --memory --config)")
    p.add_argument("--gen-pp", type=int, default=1, help="generation pipeline-parallel size pg")
    p.add_argument("--gen-world", type=int, default=0,
                   help="split placement: the last N of --world ranks generate (bytes per rank, "
                        "send balance of the split weight sync)")
    p.add_argument("--link-gbps", default=LINKS,
                   help="with --gen-world: the sync's seconds at each of these comma-separated "
                        "link speeds, Gbit/s per rank (e.g. RoCE 200, IB NDR 400; default "
                        f"{LINKS})")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    p.add_argument("--gbps", type=float, default=400.0, help="per-rank link speed, Gbit/s")
    p.add_argument("--bucket-mb", type=float, default=512.0, help="reshard bucket size, MiB")
    p.add_argument("--vocab-pad", type=int, default=None,
                   help=f"gen vocab padded to this multiple (default: {ENGINE_VOCAB_PAD}, "
                        "SGLang's; 0 with --engine builtin); 0: megatron's padded training vocab, "
                        "as the builtin engine has it")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    m = p.add_argument_group("--memory: per-GPU bytes by phase and a verdict")
    m.add_argument("--memory", action="store_true", help="plan memory instead of the reshard")
    m.add_argument("--config", help="a hybridrl YAML config: its layouts, dtype, budgets, "
                   "recompute/sp and offload flags (the model size still from --model)")
    m.add_argument("--gpu-gb", type=float, default=None, help="GPU memory in GB (80, 141, ...; "
                   "default 80, with --time/--search the --gpu's)")
    m.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node: the reshard's bytes inside / across nodes")
    m.add_argument("--mem-fraction-static", type=float, default=None,
                   help="SGLang's static pool (weights + KV) as a share of the free memory at "
                        "its start (default: the config's rollout.engine_kwargs / "
                        "rollout.mem_fraction_static, else 0.5)")
    m.add_argument("--max-tokens-per-gpu", type=int, default=16384,
                   help="padded tokens of one training micro-batch (ppo_max_token_len_per_gpu)")
    m.add_argument("--forward-tokens-per-gpu", type=int, default=0, help="tokens of one "
                   "forward-only micro-batch (log_prob_max_token_len_per_gpu; 0: as training)")
    m.add_argument("--seq-len", type=int, default=4096, help="prompt + response tokens")
    m.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    m.add_argument("--sp", action="store_true", help="sequence parallel (tp > 1)")
    m.add_argument("--offload", default="", help="comma list of params,grads,optim kept in "
                   "host memory outside their phases (actor, critic; params: reference too)")
    m.add_argument("--rollout-seqs", type=int, default=8192,
                   help="sequences generated per step (prompts x rollout.n)")
    m.add_argument("--no-critic", action="store_true", help="GRPO: no critic")
    m.add_argument("--no-ref", action="store_true", help="no reference model (no KL term)")
    m.add_argument("--no-dist-opt", action="store_true",
                   help="plain optimizer (state on every DP rank)")
    m.add_argument("--spec", choices=("te", "local"), default="te",
                   help="layer spec: te (GPU) or local (megatron's CPU path)")
    p.add_argument("--engine", choices=("sglang", "builtin"), default="sglang",
                   help="rollout engine: its vocab padding; with --memory, builtin reads the "
                        "rank's own training shards in place, so those bytes count once")
    from hybridrl.planning.timecli import add_time_args

    add_time_args(p)
    p.set_defaults(func=_cmd_plan)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="dry run of the train->gen reshard: bytes, peak, time")
    _fill(p)
    return p


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def main(argv: list[str] | None = None) -> int:
    """``hybridrl plan`` standalone: 0 on success, 2 with one line on stderr for bad input."""
    parser = _OneLineParser(prog="hybridrl plan")
    _fill(parser)
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        return args.func(args)
    except ValueError as err:
        print(f"hybridrl plan: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
