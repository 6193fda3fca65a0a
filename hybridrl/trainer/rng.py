"""The trainer's own random state, kept apart from the caller's global generators.

Contract: ``RngScope()`` holds one set of global random states: torch's CPU generator, every
CUDA device's generator (when CUDA is initialized), numpy's legacy global ``RandomState`` and
Python's ``random``. ``with scope:`` saves the caller's states, installs the scope's own, runs
the block, keeps the block's final states as the scope's own and puts the caller's back (also
when the block raises). Nested ``with`` of one scope is a no-op inside the outer one, so a
method that calls another scoped method swaps once; ``own_rng(method)`` decorates a method of an
object whose ``_rng`` is an ``RngScope`` so that it runs inside it. A fresh scope starts from the caller's
states at its first entry: whatever the block seeds (``torch.manual_seed`` inside the model
build, a checkpoint's restored RNG states) stays inside the scope.

Why: megatron's weight initialization and dropout draw from torch's global generator, and
hybridrl's checkpoints save and restore the global states; a trainer built and stepped from a
user's Python program must neither reseed nor advance the program's own generators
(``hybridrl.trainer.ppo.PPOTrainer`` enters its scope in ``__init__``, ``train_step``,
``validate``, ``save`` and ``fit``). Swapping costs a few kilobytes of copies per call. Not
covered: another thread drawing from the global generators while a scoped call runs (the
generators are process-wide), and megatron's model-parallel RNG tracker (megatron's own state,
seeded by the model build).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def _capture() -> dict[str, Any]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "numpy": np.random.get_state(),
            "python": random.getstate()}


def _install(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


class RngScope:
    """The trainer's global random states (see module docstring)."""

    def __init__(self) -> None:
        self._own: dict[str, Any] | None = None
        self._outer: dict[str, Any] | None = None
        self._depth = 0

    def __enter__(self) -> RngScope:
        self._depth += 1
        if self._depth == 1:
            self._outer = _capture()
            if self._own is not None:
                _install(self._own)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._own = _capture()
            _install(self._outer)  # CUDA first initialized inside: nothing of the caller's to
            # give back there, its generators stay as the block left them (module docstring)
            self._outer = None


def own_rng(method: Callable) -> Callable:
    """``method`` run inside ``self._rng`` (see the module docstring)."""
    @functools.wraps(method)
    def scoped(self, *args: Any, **kwargs: Any) -> Any:
        with self._rng:
            return method(self, *args, **kwargs)
    return scoped
