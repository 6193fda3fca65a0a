"""Deprecated alias of ``hybridrl.algos`` (kept for one release; removed in 0.3).

Contract: ``hybridrl.ppo.<name>`` for every name ``hybridrl.algos`` exports returns that object
and emits one ``DeprecationWarning`` naming the new home. The former submodules moved:
the algorithm math to ``hybridrl.algos.*``, the loops and their run machinery to
``hybridrl.trainer.*`` (``trainer`` -> ``trainer.ppo``, ``sft_loop`` -> ``trainer.sft``,
``memory`` -> ``trainer.phase_memory``), checkpoints to ``hybridrl.checkpoint.*``
(``checkpoint`` -> ``checkpoint.folder``, ``checkpointing`` -> ``checkpoint.checkpointer``,
``ckpt_shards`` -> ``checkpoint.shards``, ``run_dir`` -> ``checkpoint.run_folder``).
"""

from __future__ import annotations

import importlib
import warnings


def __getattr__(name: str):
    algos = importlib.import_module("hybridrl.algos")
    if name not in algos.__all__:
        raise AttributeError(f"module 'hybridrl.ppo' has no attribute {name!r} (hybridrl.ppo is "
                             "a deprecated alias of hybridrl.algos)")
    warnings.warn(f"hybridrl.ppo.{name} moved to hybridrl.algos.{name}; hybridrl.ppo will be "
                  "removed in 0.3", DeprecationWarning, stacklevel=2)
    return getattr(algos, name)
