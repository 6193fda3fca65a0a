"""The SFT entrypoint: ``torchrun --nproc-per-node N -m hybridrl.sft --config a.yaml k=v``.

Contract: ``--config`` files and ``key=value`` overrides as ``hybridrl.train`` takes them (no
``--config-name``; one ``HybridRLConfig``:
``model``, ``parallel`` and ``data`` shared with the RL run, the ``sft`` section for the rest).
Every rank loads and checks the config, the layout and the start-up checks
(``hybridrl.trainer.startup``, plus ``sft.output_dir`` writable) BEFORE any collective; a problem
exits every rank with status 2 and one line. Then it builds the groups and the ``SFTTrainer``
(``hybridrl.trainer.sft``), trains ``sft.total_steps`` steps and writes
``<sft.output_dir>/hf`` (the folder an RL run loads with ``model.path``), ``config.yaml`` (the
resolved config), ``metrics.jsonl`` and ``generations.jsonl``. A failure after the start is one
line and status 1. ``run_sft(cfg, groups)`` is the same minus the process set-up, for callers
that already hold the groups (the demo, tests); it returns (history, export folder).
"""

from __future__ import annotations

import os
import sys
import warnings

from hybridrl.exits import die_with_parent, one_line


def run_sft(cfg, groups, print_fn=print):
    """Train, validate and export (collective); ``(history, hf folder)``."""
    from hybridrl.config.loader import dump_config
    from hybridrl.trainer.sft import SFTTrainer

    trainer = SFTTrainer(cfg, groups, print_fn=print_fn)
    trainer.progress.phase(f"sft: {len(trainer.data)} pairs, model built, engine ready")
    if groups.rank == 0:
        os.makedirs(cfg.sft.output_dir, exist_ok=True)
        with open(os.path.join(cfg.sft.output_dir, "config.yaml"), "w") as f:
            f.write(dump_config(cfg))
    history = trainer.fit()
    folder = trainer.export(os.path.join(cfg.sft.output_dir, "hf"))
    trainer.progress.phase(f"sft: exported {folder}")
    return history, folder


def sft_startup(cfg, world: int, rank: int):
    """(train layout, gen layout, problems) of an SFT run on ``world`` ranks, before any
    collective: the layouts (ValueError when they do not fit), the DP split of the SFT batch,
    the trainer's start-up checks and a writable ``sft.output_dir`` (one line each)."""
    from hybridrl.train import build_layout
    from hybridrl.trainer.startup import _writable, check_startup

    train, gen = build_layout(cfg, world)
    cfg.sft.check_dp(train.dp)
    problems = check_startup(cfg, rank)
    problem = _writable("sft.output_dir", cfg.sft.output_dir, rank)
    return train, gen, problems + ([problem] if problem else [])


def main(argv=None) -> int:
    from hybridrl.train import _fail, parse_args

    args = parse_args(argv)
    for pattern in (".*Transformer Engine and Apex.*", ".*Apex is not installed.*",
                    ".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    die_with_parent()
    try:
        from hybridrl.config.loader import load_config

        cfg = load_config(args.config, args.overrides, world_size=world)
        train, gen, problems = sft_startup(cfg, world, rank)
    except Exception as err:
        return _fail(rank, 2, one_line(err))
    if problems:
        return _fail(rank, 2, "; ".join(problems))
    import torch

    from hybridrl.parallel.groups import build_groups, init_distributed

    if "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"),
                          RANK="0", WORLD_SIZE="1")
    timeout_s = cfg.trainer.collective_timeout_s
    init_distributed("gloo" if cfg.trainer.device == "cpu" else None, timeout_s=timeout_s)
    torch.manual_seed(cfg.trainer.seed)
    try:
        run_sft(cfg, build_groups(train, gen, timeout_s=timeout_s))
    except (Exception, KeyboardInterrupt) as err:
        return _fail(rank, 130 if isinstance(err, KeyboardInterrupt) else 1, one_line(err))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
