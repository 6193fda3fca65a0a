"""Deprecated alias of the folders ``hybridrl/ppo`` was split into (kept for one release; removed
in 0.3).

Contract:
- ``hybridrl.ppo.<name>`` for every name ``hybridrl.algos`` exports returns that object and
  emits one ``DeprecationWarning`` naming the new home.
- ``import hybridrl.ppo.<module>`` (and ``from hybridrl.ppo.<module> import x``) for every former
  submodule returns the module at its new path (``MOVED``) and emits one ``DeprecationWarning``
  naming it: the algorithm math moved to ``hybridrl.algos.*``, the loops and their run machinery
  to ``hybridrl.trainer.*``, checkpoints and the run folder to ``hybridrl.checkpoint.*``. The
  redirect is a meta-path finder that answers only for ``hybridrl.ppo.<former submodule>``; it is
  installed when this package is imported, which only old code does.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import MappingProxyType

MOVED = MappingProxyType({
    **{m: f"hybridrl.algos.{m}" for m in
       ("advantages", "dist_advantages", "agg", "masked", "kl_control", "losses")},
    **{m: f"hybridrl.trainer.{m}" for m in
       ("startup", "guards", "progress", "validation", "metrics_log", "tracking", "on_policy")},
    "trainer": "hybridrl.trainer.ppo", "sft_loop": "hybridrl.trainer.sft",
    "memory": "hybridrl.trainer.phase_memory",
    "checkpoint": "hybridrl.checkpoint.folder", "checkpointing": "hybridrl.checkpoint.checkpointer",
    "ckpt_shards": "hybridrl.checkpoint.shards", "export": "hybridrl.checkpoint.export",
    "run_dir": "hybridrl.checkpoint.run_folder", "run_identity": "hybridrl.checkpoint.run_identity",
})


def __getattr__(name: str):
    algos = importlib.import_module("hybridrl.algos")
    if name not in algos.__all__:
        raise AttributeError(f"module 'hybridrl.ppo' has no attribute {name!r} (hybridrl.ppo is "
                             "a deprecated alias of hybridrl.algos)")
    warnings.warn(f"hybridrl.ppo.{name} moved to hybridrl.algos.{name}; hybridrl.ppo will be "
                  "removed in 0.3", DeprecationWarning, stacklevel=2)
    return getattr(algos, name)


class _Redirect(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``hybridrl.ppo.<former submodule>`` -> the module at its new path (with a warning)."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, tail = fullname.rpartition(".")
        if head != __name__ or tail not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name.rpartition(".")[2]]
        warnings.warn(f"{spec.name} moved to {new}; hybridrl.ppo will be removed in 0.3",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        """The module is already the executed one at its new path."""


if not any(isinstance(f, _Redirect) for f in sys.meta_path):
    sys.meta_path.append(_Redirect())
