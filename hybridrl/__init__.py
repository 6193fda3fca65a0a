"""hybridrl: KL-regularized PPO/GRPO for LLMs on a Megatron-style 3D-parallel layout.

Contract: ``import hybridrl`` is import-light (no torch.distributed groups, no megatron-core, no
GPU extra, not even torch): the names in ``__all__`` are the stable library surface, each loaded
from its home module on first attribute access (module ``__getattr__``, PEP 562) and cached in the
module namespace by Python afterwards. docs/api.md describes every name; the groups are:

- layouts and groups: ``TrainLayout``, ``GenLayout``, ``init_distributed``, ``build_groups``;
- reshard: ``LlamaShape``, ``build_specs``, ``train_placement``, ``gen_placement``,
  ``plan_reshard``, ``Assembler``, ``run_plan``, ``train_sources``, ``engine_format``,
  ``hf_format``, ``sync_engine`` (plan -> any engine with ``update_weights``/``finish_update``);
- models: ``read_hf_spec``, ``build_from_hf``, ``named_local_parameters``;
- kernels: ``kl_penalty``, ``gae``, ``masked_whiten``;
- losses / advantages / KL control: ``compute_policy_loss``, ``value_loss``, ``kl_loss``,
  ``entropy_loss``, ``actor_loss``, ``agg_loss``, ``compute_advantage``,
  ``register_advantage_estimator``, ``register_policy_loss``, ``FixedKLController``,
  ``AdaptiveKLController``, ``build_kl_controller``, ``apply_kl_in_reward``;
- rewards: ``REWARD_FNS`` (data_source -> function), ``RewardScorer``;
- rollout: ``RolloutEngine``, ``SamplingParams``, ``GenerationOutput``, ``BuiltinEngine``;
- the trainer: ``load_config``, ``HybridRLConfig``, ``PPOTrainer``, ``build_trainer`` (layout,
  groups and trainer from a config, with prompts / rewards / estimator as Python objects),
  ``build_layout``, ``PromptRow``.
An unknown attribute raises ``AttributeError`` naming the module.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

__version__ = "0.1.0"

_HOME = MappingProxyType({
    "hybridrl.parallel.layout": ("TrainLayout", "GenLayout"),
    "hybridrl.parallel.groups": ("init_distributed", "build_groups"),
    "hybridrl.reshard.specs": ("LlamaShape", "build_specs"),
    "hybridrl.reshard.placement": ("train_placement", "gen_placement"),
    "hybridrl.reshard.planner": ("plan_reshard",),
    "hybridrl.reshard.assemble": ("Assembler",),
    "hybridrl.reshard.executor": ("run_plan", "train_sources"),
    "hybridrl.reshard.formats": ("engine_format", "hf_format"),
    "hybridrl.rollout.worker": ("sync_engine",),
    "hybridrl.models.spec": ("read_hf_spec",),
    "hybridrl.models.hf_io": ("build_from_hf",),
    "hybridrl.models.naming": ("named_local_parameters",),
    "hybridrl.kernels": ("kl_penalty", "gae", "masked_whiten"),
    "hybridrl.algos.losses": ("compute_policy_loss", "value_loss", "kl_loss", "entropy_loss",
                            "actor_loss", "register_policy_loss"),
    "hybridrl.algos.agg": ("agg_loss",),
    "hybridrl.algos.advantages": ("compute_advantage", "register_advantage_estimator"),
    "hybridrl.algos.kl_control": ("FixedKLController", "AdaptiveKLController",
                                "build_kl_controller", "apply_kl_in_reward"),
    "hybridrl.rewards.scoring": ("REWARD_FNS", "RewardScorer"),
    "hybridrl.rollout.base": ("RolloutEngine", "SamplingParams", "GenerationOutput"),
    "hybridrl.rollout.builtin.engine": ("BuiltinEngine",),
    "hybridrl.config": ("load_config", "HybridRLConfig"),
    "hybridrl.trainer.ppo": ("PPOTrainer",),
    "hybridrl.trainer.entry": ("build_trainer", "build_layout"),
    "hybridrl.data.schema": ("PromptRow",),
})

__all__ = sorted(name for names in _HOME.values() for name in names)


def __getattr__(name: str) -> object:
    """The exported ``name``, imported from its home module (see the module docstring)."""
    for module, names in _HOME.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'hybridrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and every exported one."""
    return sorted([*globals(), *__all__])
