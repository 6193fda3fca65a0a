"""The demo: SFT warm start, then PPO (or GRPO) from it, in one torchrun job.

    torchrun --standalone --nproc-per-node 4 -m hybridrl.demo --config configs/demo_cpu.yaml [k=v]

Contract: every rank loads the config (``hybridrl.train``'s loading and start-up checks, every
rank before any collective; a bad config exits 2 with one line), builds the groups once, runs
``hybridrl.sft.run_sft`` (with ``parallel.placement=split`` on the training ranks only: the last
``parallel.gen.world`` ranks wait, then generate for the PPO run; ``make demo ASYNC=1``) (data written, SFT, greedy validation, HF export to
``<sft.output_dir>/hf``), then builds a ``PPOTrainer`` from that export (``model.path``; the
critic's trunk and the reference start from it too) with the same groups and fits
``trainer.total_steps`` steps in its run folder ``<trainer.output_dir>/<trainer.experiment_name>``.
Rank 0 then writes the plot into it (``hybridrl.plot``, when matplotlib is installed) and
prints exactly one closing line:

    demo: val/score/mean SFT <a> -> RL <b> (metrics: <path>, plot: <path>)

where ``a`` is the SFT model's greedy validation score and ``b`` the RL run's last one; ``plot``
is ``none`` without matplotlib. ``run_demo(load, groups)`` (``load(extra_overrides)`` -> config)
returns ``(a, b, metrics path, plot path)``; the plot path is ``none`` on ranks other than 0.
``run_demo(..., sft=(a, folder))`` starts PPO from an SFT export made before (by ``run_sft`` with
the same ``sft`` and ``data`` sections, on any layout: the export is HF files) instead of
training one: the tests share one warm start between the demo's two placements.

Tools (``make demo TOOLS=1``, ``configs/demo_tools.yaml``: ``rollout.multi_turn.enable``): the
data are ``hybridrl.data.tool_arithmetic``'s (written by rank 0 into ``data.synthetic.dir``:
prompts, and SFT transcripts that call the calculator a ``sft.synthetic_format_fraction`` of
the time), PPO runs as ``MultiTurnPPOTrainer`` and ``a`` is the SFT model's held-out score
*with tools* (the RL run's validation before its first step, ``trainer.val_before_train``).
The closing line then adds the held-out tool-call rate before and after RL:

    demo: val/score/mean SFT <a> -> RL <b> (tool calls SFT <r0> -> RL <r1>; metrics: .., plot: ..)

``MultiTurnPPOTrainer``: ``PPOTrainer`` (which runs the multi-turn loop itself when
``rollout.multi_turn.enable``) keeping every validation's metrics, for the rates above.
"""

from __future__ import annotations

import os
import sys
import warnings

from hybridrl.exits import die_with_parent, one_line
from hybridrl.trainer.ppo import PPOTrainer


class MultiTurnPPOTrainer(PPOTrainer):
    """``PPOTrainer`` that keeps every validation's metrics (the demo's tool-call rates)."""

    def __init__(self, *args, **kwargs) -> None:
        self.val_history: list[dict] = []
        super().__init__(*args, **kwargs)

    def validate(self) -> dict:
        metrics = super().validate()
        self.val_history.append(metrics)
        return metrics


def _tool_data(cfg, groups) -> list[str]:
    """Rank 0 writes the tool task's files; every rank gets the overrides that use them."""
    import torch.distributed as dist

    from hybridrl.data.tool_arithmetic import write_tool_dataset

    syn = cfg.data.synthetic
    paths = [None, None, None]
    if groups.rank == 0:
        paths = list(write_tool_dataset(syn.dir, syn.train_size, syn.val_size, cfg.data.seed,
                                        syn.max_digits, cfg.sft.synthetic_format_fraction))
    if dist.is_initialized():
        dist.broadcast_object_list(paths, src=0)
    train, test, sft = paths
    return [f"data.train_files=[{train}]", f"data.val_files=[{test}]",
            f"sft.train_files=[{sft}]"]


def run_demo(load, groups, print_fn=print, split=None,
             sft: tuple[float, str] | None = None,
             info: dict | None = None) -> tuple[float, float, str, str]:
    """``load(extra_overrides)`` -> config. Returns (SFT score, RL score, metrics, plot).
    ``split``: the training ranks' ``SplitGroups`` (``parallel.placement=split``). ``sft``:
    (SFT score, HF export folder) of a warm start already made; None trains it here.
    ``info``: a dict that receives ``tool_rates`` (held-out tool-call rate before, after RL)."""
    from hybridrl.sft import run_sft

    cfg = load([])
    tools = cfg.rollout.multi_turn.enable
    extra = _tool_data(cfg, groups) if tools else []
    if extra:
        cfg = load(extra)
    if sft is None:
        history, folder = run_sft(cfg, groups, print_fn=print_fn)
        sft = (history[-1].get("val/score/mean", float("nan")), folder)
    sft_score, folder = sft
    rl_cfg = load([*extra, f"model.path={folder}", "model.tokenizer_path=char"])
    trainer = (MultiTurnPPOTrainer if tools else PPOTrainer)(rl_cfg, groups, print_fn=print_fn,
                                                              split=split)
    rl = trainer.fit()
    if tools:
        vals = [m for m in trainer.val_history if "val/score/mean" in m]
        sft_score = vals[0]["val/score/mean"] if vals else float("nan")
        (info if info is not None else {})["tool_rates"] = (vals[0].get("val/multi_turn/tool_calls/rate", float("nan")),
                               vals[-1].get("val/multi_turn/tool_calls/rate", float("nan")))
    if split is not None:
        trainer.worker.close()  # the generation ranks' loop ends
    scores = [m["val/score/mean"] for m in rl if "val/score/mean" in m]
    run_dir = rl_cfg.trainer.run_dir
    metrics = os.path.join(run_dir, "metrics.jsonl")
    plot = "none"
    if groups.rank == 0:
        try:
            from hybridrl.plot import plot_run

            plot = plot_run(run_dir, sft_metrics=os.path.join(cfg.sft.output_dir, "metrics.jsonl"))
        except ImportError as err:
            print_fn(f"hybridrl.demo: no plot ({err})", flush=True)
    return sft_score, (scores[-1] if scores else float("nan")), metrics, plot


def _run_split(cfg, load, train, timeout_s: float, sft=None):
    from hybridrl.parallel.split import build_split_groups, training_world
    from hybridrl.rollout.split.server import serve

    split = build_split_groups(train, cfg.parallel.gen.world, cfg.parallel.gen.tp, timeout_s)
    if split.is_gen:
        serve(cfg, split)
        return float("nan"), float("nan"), "", "none"
    with training_world(split):
        return run_demo(load, split.groups, split=split, sft=sft)


def main(argv=None) -> int:
    from hybridrl.train import _fail, parse_args

    args = parse_args(argv)
    for pattern in (".*Transformer Engine and Apex.*", ".*Apex is not installed.*",
                    ".*full scope is deprecated.*", ".*is deprecated.*", ".*non-leaf Tensor.*"):
        warnings.filterwarnings("ignore", message=pattern)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    die_with_parent()
    try:
        from hybridrl.config.loader import load_config
        from hybridrl.sft import sft_startup

        def load(extra):
            return load_config(args.config, [*args.overrides, *extra], world_size=world)

        cfg = load([])
        cfg.check_world(world)
        train, gen, problems = sft_startup(cfg, world, rank)
    except Exception as err:
        return _fail(rank, 2, one_line(err))
    if problems:
        return _fail(rank, 2, "; ".join(problems))
    import torch

    from hybridrl.parallel.groups import build_groups, init_distributed

    timeout_s = cfg.trainer.collective_timeout_s
    info: dict = {}  # run_demo's extras (the tool demo's call rates)
    init_distributed("gloo" if cfg.trainer.device == "cpu" else None, timeout_s=timeout_s)
    torch.manual_seed(cfg.trainer.seed)
    try:
        if cfg.parallel.split:  # SFT and PPO on the training ranks; the others generate
            a, b, metrics, plot = _run_split(cfg, load, train, timeout_s)
        else:
            a, b, metrics, plot = run_demo(load, build_groups(train, gen, timeout_s=timeout_s),
                                           info=info)
    except (Exception, KeyboardInterrupt) as err:
        return _fail(rank, 130 if isinstance(err, KeyboardInterrupt) else 1, one_line(err))
    if rank == 0:
        rates = info.get("tool_rates")
        tools = "" if rates is None else f"tool calls SFT {rates[0]:.3f} -> RL {rates[1]:.3f}; "
        print(f"demo: val/score/mean SFT {a:.3f} -> RL {b:.3f} ({tools}metrics: {metrics}, "
              f"plot: {plot})", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
