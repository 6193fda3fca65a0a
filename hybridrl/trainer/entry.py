"""The documented way to build the PPO trainer from Python: layout, groups and trainer in one call.

Contract:
- ``build_layout(cfg, world)`` (pure): ``(TrainLayout, GenLayout or None)`` of the config's
  ``parallel`` section for ``world`` ranks: training tp x pp x dp over ``world`` (minus
  ``parallel.gen.world`` under split placement), and the generation layout when it nests in
  the training one (``parallel.gen.tp`` dividing ``parallel.tp``, ...); the same layouts
  ``python -m hybridrl.train`` builds.
- ``build_trainer(cfg, *, train_data=None, val_data=None, reward_fn=None, adv_estimator=None,
  print_fn=print)`` (every rank, same arguments): uses the default process group, or starts a
  world of one (gloo on ``trainer.device=cpu``, else NCCL; on a free local port, no environment
  variable set) when none is initialized and ``WORLD_SIZE`` is unset; checks the config against
  the world size (``HybridRLConfig.check_world``) and runs the start-up checks
  (``hybridrl.trainer.startup.check_startup``: folders, model and tokenizer files, loggers,
  registered names, the parquet files when ``train_data`` is not given); the ranks then agree
  (one ``all_gather_object``), so a problem on any rank raises the same one-line ``ValueError``
  on every rank before any group is built. The run's folders are made absolute first, and
  rank 0 then takes the locks over every folder the run writes (``lock_run_folders``: a live
  run on the run folder or ``trainer.checkpoint_dir`` is the same one-line ``ValueError`` on
  every rank, before any model is built; the locks live on the trainer as ``run_locks``, the
  same as ``python -m hybridrl.train`` takes). Then it builds the groups
  (``hybridrl.parallel.build_groups`` with ``trainer.collective_timeout_s``) and returns
  ``PPOTrainer(cfg, groups, train_data=..., val_data=..., reward_fn=..., adv_estimator=...)``
  (``hybridrl.trainer.inputs`` says what each accepts). ``parallel.placement=split`` is
  refused (its generation ranks serve under ``python -m hybridrl.train`` only).
  The caller owns the process group (``torch.distributed.destroy_process_group()`` when done).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from hybridrl.config.root import HybridRLConfig
from hybridrl.parallel.layout import GenLayout, TrainLayout
from hybridrl.trainer.inputs import agree, with_estimator
from hybridrl.trainer.ppo import PPOTrainer
from hybridrl.trainer.startup import (
    check_startup,
    code_sandbox_problems,
    lock_run_folders,
    resolve_paths,
)


def build_layout(cfg: HybridRLConfig, world: int) -> tuple[TrainLayout, GenLayout | None]:
    """(training layout, generation layout or None) of ``cfg`` for ``world`` ranks (pure)."""
    p = cfg.parallel
    train = TrainLayout(world=p.train_world(world), tp=p.tp, pp=p.pp, order=p.order, ep=p.ep,
                        etp=p.expert_tp)
    gen = GenLayout(train, tp=p.gen.tp, pp=p.gen.pp, grouping=p.gen.grouping) if p.nested else None
    return train, gen


def _world_of_one(cfg: HybridRLConfig) -> None:
    """A one-rank default group on a free local port (no environment variable is set)."""
    import datetime

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "gloo" if cfg.trainer.device == "cpu" else None
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=cfg.trainer.collective_timeout_s))


def build_trainer(cfg: HybridRLConfig, *, train_data: Any = None, val_data: Any = None,
                  reward_fn: Callable | Mapping[str, Callable] | None = None,
                  adv_estimator: str | Callable | None = None,
                  print_fn: Callable[..., None] = print) -> PPOTrainer:
    """The PPO trainer of ``cfg`` on the current process group (see the module docstring)."""
    import torch.distributed as dist

    from hybridrl.parallel.groups import build_groups, init_distributed

    if not isinstance(cfg, HybridRLConfig):
        raise ValueError(f"cfg must be a HybridRLConfig (hybridrl.load_config); got "
                         f"{type(cfg).__name__}")
    if cfg.parallel.split:
        raise ValueError("parallel.placement=split runs under `python -m hybridrl.train` only "
                         "(its generation ranks serve there); use parallel.placement=colocated")
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:  # torchrun's ranks: the group spans them
            init_distributed("gloo" if cfg.trainer.device == "cpu" else None,
                             timeout_s=cfg.trainer.collective_timeout_s)
        else:
            _world_of_one(cfg)
    world, rank = dist.get_world_size(), dist.get_rank()
    problem, layout = None, None
    cfg = resolve_paths(cfg)  # before anything reads a folder (a later os.chdir cannot move it)
    try:
        cfg = with_estimator(cfg, adv_estimator)  # it decides whether a critic is trained
        cfg.check_world(world)
        layout = build_layout(cfg, world)
        problems = check_startup(cfg, rank, data_given=train_data is not None,
                                 reward_fn=reward_fn)
        problems = problems or code_sandbox_problems(cfg, reward_fn)
        if problems:
            problem = problems[0] if len(problems) == 1 else (
                f"{len(problems)} problems: " + "; ".join(problems))
    except ValueError as err:
        problem = str(err).strip().splitlines()[0]
    agree(problem)
    locks: list = []  # rank 0: every folder the run writes, before any model is built
    if rank == 0:
        try:
            locks = lock_run_folders(cfg)
        except ValueError as err:  # StartupError: a live run holds one of them
            problem = str(err).strip().splitlines()[0]
    agree(problem)
    groups = build_groups(*layout, timeout_s=cfg.trainer.collective_timeout_s)
    trainer = PPOTrainer(cfg, groups, train_data=train_data, val_data=val_data,
                         reward_fn=reward_fn, print_fn=print_fn)
    trainer.run_locks = locks  # held as long as the trainer lives
    return trainer
