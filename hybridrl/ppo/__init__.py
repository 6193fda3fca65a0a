"""Deprecated alias of the folders ``hybridrl/ppo`` was split into (kept for one release; removed
in 0.3).

Contract:
- ``hybridrl.ppo.<name>`` for every name ``hybridrl.algos`` exports returns that object and
  emits one ``DeprecationWarning`` naming the new home.
- ``import hybridrl.ppo.<module>`` (and ``from hybridrl.ppo.<module> import x``) for every former
  submodule returns the module at its new path (``MOVED``) and emits one ``DeprecationWarning``
  naming it: the algorithm math moved to ``hybridrl.algos.*``, the loops and their run machinery
  to ``hybridrl.trainer.*``, checkpoints and the run folder to ``hybridrl.checkpoint.*``. The
  redirect (``hybridrl.deprecation.redirect_modules``) answers only for
  ``hybridrl.ppo.<former submodule>``; it is installed when this package is imported, which only
  old code does.
"""

from __future__ import annotations

import importlib
import warnings
from types import MappingProxyType

from hybridrl.deprecation import redirect_modules

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


redirect_modules({f"{__name__}.{old}": new for old, new in MOVED.items()}, "0.3")
