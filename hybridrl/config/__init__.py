"""hybridrl's configuration: structured dataclasses, the single home of every default.

Contract: ``load_config(yaml_paths, overrides)`` returns a validated, frozen ``HybridRLConfig``
(defaults <- YAML files in order <- ``key=value`` overrides in order). Each component receives its
own section (``cfg.actor``, ``cfg.parallel``, ...). docs/config.md lists every key; regenerate it
with ``python scripts/gen_config_docs.py`` after changing a section.

Rooms: the schema (one module per section, ``_fields``, ``schema``) at the bottom; ``verl/``
(verl's keys and their translation) above it; ``loader`` (files + overrides -> config) and
``reference`` (docs/config.md) on top. The former ``hybridrl.config.verl_keys`` /
``verl_translate`` still import, with a DeprecationWarning naming the new home, until 0.3.
"""

from types import MappingProxyType

from hybridrl.config.algorithm import AlgorithmConfig, KLCtrlConfig, RewardConfig
from hybridrl.config.data import DataConfig, SyntheticDataConfig
from hybridrl.config.loader import dump_config, load_config
from hybridrl.config.model import ModelConfig
from hybridrl.config.parallel import (
    GenParallelConfig,
    KernelsConfig,
    ParallelConfig,
    ReshardConfig,
)
from hybridrl.config.roles import ActorConfig, CriticConfig, RefConfig
from hybridrl.config.rollout import RolloutConfig
from hybridrl.config.root import HybridRLConfig
from hybridrl.config.sft import SFTConfig
from hybridrl.config.trainer import KLGuardConfig, TrainerConfig
from hybridrl.deprecation import redirect_modules

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "GenParallelConfig",
    "HybridRLConfig",
    "KLCtrlConfig",
    "KLGuardConfig",
    "KernelsConfig",
    "ModelConfig",
    "ParallelConfig",
    "RefConfig",
    "ReshardConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "SyntheticDataConfig",
    "TrainerConfig",
    "dump_config",
    "load_config",
]

MOVED = MappingProxyType({f"{__name__}.verl_{m}": f"{__name__}.verl.{m}"
                          for m in ("keys", "translate")})
redirect_modules(MOVED, "0.3")
