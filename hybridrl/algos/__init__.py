"""The RL algorithms: PPO/GRPO math as pure functions (verl's numbers), plus plug-in registries.

Contract: tensors in, tensors out. This folder imports only the floors below it (kernels,
the registry) and never the run machinery (``hybridrl.trainer``), checkpoints
(``hybridrl.checkpoint``), models, rollout or data: ``tests/unit/test_layering.py`` checks it.

- ``masked``: masked sum/mean/var/whiten, entropy from logits.
- ``agg``: ``agg_loss`` (token-mean, seq-mean-token-sum, seq-mean-token-mean,
  seq-mean-token-sum-norm) with optional global DP normalizers (``compute_agg_normalizers``).
- ``advantages``: ``compute_advantage`` over ``ADVANTAGE_ESTIMATORS`` (gae, grpo, rloo,
  reinforce_plus_plus, reinforce_plus_plus_baseline, yours).
- ``losses``: policy loss (``POLICY_LOSSES``: vanilla, gspo, yours), value, entropy, KL loss,
  actor loss.
- ``rollout_correction``: truncated importance weights of the trainer's vs the engine's
  log-probs (``actor.rollout_is``).
- ``kl_control``: fixed/adaptive KL controllers and the in-reward KL penalty.
- ``dist_advantages``: ``compute_advantage`` over a DP-sharded batch (group statistics and
  whitening all-reduced over the given DP group).

No process group is needed except by ``compute_agg_normalizers`` when given a DP group.
The training loop lives elsewhere (``hybridrl.trainer.ppo``).
"""

from hybridrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantage,
    gae_advantages,
    grpo_advantages,
    register_advantage_estimator,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from hybridrl.algos.agg import AGG_MODES, AggNormalizers, agg_loss, compute_agg_normalizers
from hybridrl.algos.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
)
from hybridrl.algos.losses import (
    POLICY_LOSSES,
    actor_loss,
    compute_policy_loss,
    entropy_loss,
    gspo_policy_loss,
    kl_loss,
    register_policy_loss,
    value_loss,
    vanilla_policy_loss,
)
from hybridrl.algos.masked import (
    entropy_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from hybridrl.algos.rollout_correction import rollout_is_metrics, rollout_is_weights
from hybridrl.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AggNormalizers",
    "FixedKLController",
    "Registry",
    "actor_loss",
    "agg_loss",
    "apply_kl_in_reward",
    "build_kl_controller",
    "compute_advantage",
    "compute_agg_normalizers",
    "compute_policy_loss",
    "entropy_from_logits",
    "entropy_loss",
    "gae_advantages",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_advantage_estimator",
    "register_policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "rollout_is_metrics",
    "rollout_is_weights",
    "value_loss",
    "vanilla_policy_loss",
]
