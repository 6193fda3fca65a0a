"""Rank-side bodies of the checkpoint tests (module level so forkserver ranks can import them).

A case is (name, overrides, action, arg); every rank builds a ``PPOTrainer`` from
``test_trainer_cases.base_overrides`` plus the case's overrides and runs ``action``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from tests.distributed.test_trainer_cases import _clean, _trainer, base_overrides


def _fit(rank, world, overrides, arg):
    return _fit_trainer(*_trainer(rank, world, overrides))


def _fit_trainer(trainer, lines):
    start = time.perf_counter()
    history = trainer.fit()
    return {"metrics": _clean(history), "lines": lines, "step": trainer.step,
            "s": time.perf_counter() - start, "save_s": trainer.ckpt.last_save_s}


def _corrupt_then_fit(rank, world, overrides, arg):
    """Rank 0 damages ``arg = (file, how)`` or a list of them (how: truncate | flip a byte), then
    every rank fits."""
    if rank == 0:
        for file, how in [arg] if isinstance(arg[0], str) else arg:
            path = Path(file)
            data = bytearray(path.read_bytes())
            if how == "truncate":
                data = data[: len(data) // 2]
            else:
                data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
    dist.barrier()
    lines: list[str] = []
    try:
        trainer, lines = _trainer(rank, world, overrides)
        return _fit_trainer(trainer, lines)
    except ValueError as err:  # StartupError: the checkpoint cannot be resumed
        return {"error": str(err), "lines": lines}


def _logprobs(rank, world, overrides, arg):
    """Resume (nothing left to train), then the actor's log-probs on this rank's rollout rows."""
    trainer, _ = _trainer(rank, world, overrides)
    trainer.fit()
    trainer.memory.enter("all")
    trainer.worker.sync_weights(trainer.actor)
    rb = trainer._rollout(trainer.loader.next_batch())
    lp = trainer._logprobs(trainer.actor, rb)
    return {"prompts": rb.prompt_ids, "responses": rb.response_ids, "mask": rb.response_mask,
            "logprobs": lp}


def _spike(rank, world, overrides, arg):
    """Fit with a KL spike injected at the steps in ``arg`` (each once, or always: 'always')."""
    trainer, lines = _trainer(rank, world, overrides)
    judge, seen = trainer.guard.judge, set()

    def spiking(step, metrics, *args):
        if arg == "always" or (step in arg and step not in seen):
            seen.add(step)
            metrics = {**metrics, "actor/ppo_kl_max": 1e9}
        return judge(step, metrics, *args)

    trainer.guard.judge = spiking
    try:
        history = trainer.fit()
    except RuntimeError as err:
        return {"error": str(err), "lines": lines}
    return {"metrics": _clean(history), "lines": lines, "error": None,
            "lr": trainer.actor_opt.lr_scale, "critic_lr": trainer.critic_opt.lr_scale}


ACTIONS = {"fit": _fit, "corrupt": _corrupt_then_fit, "logprobs": _logprobs, "spike": _spike}


def run_cases(rank: int, world: int, root: str, cases: list) -> dict:
    out = {}
    for name, overrides, action, arg in cases:
        out[name] = ACTIONS[action](rank, world, base_overrides(root) + overrides, arg)
    return out

