"""Actor, critic and reference sections: optimizer, PPO mini/micro-batching and loss knobs.

Contract: ``ActorConfig`` and ``CriticConfig`` share the trained-role fields of
``TrainedRoleConfig`` (optimizer, LR schedule, PPO epochs and batch sizes); each adds its loss
knobs. Batch sizes follow verl's units: ``ppo_mini_batch_size`` counts prompts (the trainer
multiplies by ``rollout.n``), micro-batch sizes and token budgets are per GPU (per DP rank).
Every ``__post_init__`` raises ``ValueError`` naming the full key and the allowed values; every
float knob of these sections must be finite (``actor.lr=inf`` or ``nan`` is refused: a ``nan``
fails every comparison and an ``inf`` would pass ``> 0`` and then train on non-finite weights).
When the config comes from ``load_config``, the critic's ``ppo_mini_batch_size``, ``ppo_epochs``
and ``loss_agg_mode`` follow the actor's unless set (verl's rule; ``hybridrl.config.loader``).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from hybridrl.config._fields import (
    check_choice,
    check_non_negative,
    check_positive,
    check_range,
    knob,
)

LR_SCHEDULES = ("constant", "warmup", "cosine")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
_KL_BASE = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_KINDS = _KL_BASE + tuple(k + "+" for k in _KL_BASE)
ROLLOUT_IS_CHOICES = ("", "token", "sequence")
ROUTER_REPLAY_CHOICES = ("off", "rollout")  # actor.router_replay (MoE)


def check_finite_floats(section: str, obj: object) -> None:
    """Every float field of the dataclass ``obj`` (and every float in a list field) is finite."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            what = "finite numbers" if values is value else "a finite number"
            raise ValueError(f"{section}.{f.name} must be {what}; got {value!r}")


@dataclass(frozen=True)
class TrainedRoleConfig:
    """Fields shared by every trained model (actor, critic)."""

    SECTION: ClassVar[str] = "role"

    lr: float = knob(1e-6, "Peak learning rate (Adam).")
    lr_schedule: str = knob("constant", "LR schedule: constant (no warmup) | warmup (linear "
                            "warmup, then constant) | cosine (linear warmup, then cosine decay "
                            "to min_lr_ratio*lr).")
    warmup_steps: int = knob(0, "Linear warmup length in optimizer steps (0 with 'constant').")
    min_lr_ratio: float = knob(0.0, "Cosine schedule: final LR as a fraction of lr.")
    weight_decay: float = knob(0.01, "AdamW decoupled weight decay.")
    adam_betas: list[float] = knob([0.9, 0.999], "Adam (beta1, beta2).")
    grad_clip: float = knob(1.0, "Clip the global gradient norm to this value (0 = no clipping).")
    ppo_epochs: int = knob(1, "Passes over each rollout batch.")
    ppo_mini_batch_size: int = knob(16, "Prompts per optimizer step (times rollout.n "
                                    "responses), over all DP ranks.")
    ppo_micro_batch_size_per_gpu: int = knob(4, "Sequences per forward/backward on one DP rank "
                                             "(ignored when use_dynamic_bsz).")
    use_dynamic_bsz: bool = knob(False, "Form micro-batches by token budget instead of a fixed "
                                 "sequence count.")
    ppo_max_token_len_per_gpu: int = knob(16384, "Token budget of one dynamic micro-batch on one "
                                          "DP rank, counted with padding: rows x the longest "
                                          "row (prompt + response tokens).")
    use_distributed_optimizer: bool = knob(True, "megatron's DistributedOptimizer: Adam state "
                                           "and fp32 master weights sharded over DP (1/dp per "
                                           "rank); false = every DP rank holds all of it.")
    overlap_grad_reduce: bool = knob(True, "Reduce(-scatter) gradient buckets during the "
                                     "backward instead of after it.")
    overlap_param_gather: bool = knob(True, "With the distributed optimizer: all-gather updated "
                                      "weights during the next mini-batch's forward (the "
                                      "trainer completes the gather before reading the "
                                      "weights); no effect without it.")
    param_offload: bool = knob(False, "Keep the weights in (pinned) host memory outside the "
                               "phases that use them (colocated with the rollout engine).")
    grad_offload: bool = knob(False, "Keep the fp32 gradient buffers in host memory outside "
                              "this model's update.")
    optimizer_offload: bool = knob(False, "Keep the optimizer state (Adam moments, fp32 "
                                   "masters) in host memory outside this model's update.")

    @property
    def offload_parts(self) -> set[str]:
        """The parts this role may keep in host memory (hybridrl.trainer.phase_memory)."""
        flags = {"params": self.param_offload, "grads": self.grad_offload,
                 "optim": self.optimizer_offload}
        return {part for part, on in flags.items() if on}

    def __post_init__(self) -> None:
        s = self.SECTION
        check_finite_floats(s, self)
        check_positive(f"{s}.lr", self.lr)
        check_choice(f"{s}.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_non_negative(f"{s}.warmup_steps", self.warmup_steps)
        if self.lr_schedule == "constant" and self.warmup_steps:
            raise ValueError(f"{s}.warmup_steps must be 0 when {s}.lr_schedule is 'constant' "
                             f"(use 'warmup' or 'cosine'); got {self.warmup_steps}")
        if self.lr_schedule == "warmup" and not self.warmup_steps:
            raise ValueError(f"{s}.warmup_steps must be >= 1 when {s}.lr_schedule is 'warmup'")
        check_range(f"{s}.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_non_negative(f"{s}.weight_decay", self.weight_decay)
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"{s}.adam_betas must be two numbers in [0, 1); "
                             f"got {list(self.adam_betas)!r}")
        check_non_negative(f"{s}.grad_clip", self.grad_clip)
        for name in ("ppo_epochs", "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu",
                     "ppo_max_token_len_per_gpu"):
            check_positive(f"{s}.{name}", getattr(self, name))


@dataclass(frozen=True)
class ActorConfig(TrainedRoleConfig):
    """The policy being trained: optimizer, batching and the PPO policy loss."""

    SECTION: ClassVar[str] = "actor"

    policy_loss: str = knob("vanilla", "Policy-loss registry name: vanilla (clipped PPO with "
                            "dual clip) | gspo (sequence-level ratio and clip, its term always "
                            "aggregated seq-mean-token-mean as in verl; the GSPO paper uses "
                            "clip_ratio_low 3e-4, clip_ratio_high 4e-4) | a registered one.")
    clip_ratio_low: float = knob(0.2, "PPO clip: ratio lower bound is 1 - clip_ratio_low.")
    clip_ratio_high: float = knob(0.2, "PPO clip: ratio upper bound is 1 + clip_ratio_high.")
    clip_ratio_c: float = knob(3.0, "Dual-clip constant: loss bounded by -A*clip_ratio_c for "
                               "A < 0 (must be > 1).")
    loss_agg_mode: str = knob("token-mean", "How token losses become one number: " +
                              " | ".join(LOSS_AGG_MODES) + ".")
    entropy_coeff: float = knob(0.0, "Weight of the entropy bonus (subtracted from the loss).")
    use_kl_loss: bool = knob(False, "Add a KL(actor || ref) term to the loss (GRPO style).")
    kl_loss_coef: float = knob(0.001, "Weight of the KL loss term.")
    kl_loss_type: str = knob("low_var_kl", "KL estimator of the loss term: " +
                             " | ".join(_KL_BASE) + ", each optionally with a trailing '+' "
                             "(straight-through k2 gradient).")
    rollout_is: str = knob("", "Rollout correction: weight the policy loss by truncated "
                           "importance weights min(exp(old - engine log-prob), rollout_is_cap) "
                           "per token (token) or per sequence (sequence, summed log ratio); "
                           "empty = off.")
    rollout_is_cap: float = knob(2.0, "Truncation cap of the rollout IS weights (> 0).")
    router_replay: str = knob("off", "MoE routing replay (R3): off | rollout: the actor's "
                              "forwards replay the rollout engine's top-k expert ids of every "
                              "token and layer (megatron-core's RouterReplay), so old "
                              "log-probs and the update see the rollout's routing; "
                              "actor/router_agreement is how often the actor's own routing "
                              "chose the same experts.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.policy_loss:
            raise ValueError("actor.policy_loss must name a registered policy loss; got ''")
        check_range("actor.clip_ratio_low", self.clip_ratio_low, 0.0, 1.0, low_open=True)
        check_positive("actor.clip_ratio_high", self.clip_ratio_high)
        if not self.clip_ratio_c > 1.0:
            raise ValueError(f"actor.clip_ratio_c must be > 1.0; got {self.clip_ratio_c!r}")
        check_choice("actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check_non_negative("actor.kl_loss_coef", self.kl_loss_coef)
        check_choice("actor.kl_loss_type", self.kl_loss_type, KL_KINDS)
        check_choice("actor.rollout_is", self.rollout_is, ROLLOUT_IS_CHOICES)
        check_positive("actor.rollout_is_cap", self.rollout_is_cap)
        check_choice("actor.router_replay", self.router_replay, ROUTER_REPLAY_CHOICES)


@dataclass(frozen=True)
class CriticConfig(TrainedRoleConfig):
    """The value model (used when algorithm.adv_estimator is 'gae'). Its ppo_mini_batch_size,
    ppo_epochs and loss_agg_mode follow the actor's unless a file or override sets them."""

    SECTION: ClassVar[str] = "critic"

    lr: float = knob(1e-5, "Peak learning rate (Adam).")
    model_path: str = knob("", "Local HF folder to initialize the critic trunk from; empty = "
                           "the actor's initial weights (value head freshly initialized).")
    cliprange_value: float = knob(0.5, "Value clip: v_clipped = old_v + clip(v - old_v, "
                                  "-cliprange_value, cliprange_value).")
    loss_agg_mode: str = knob("token-mean", "Aggregation of the value loss: " +
                              " | ".join(LOSS_AGG_MODES) + ".")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("critic.cliprange_value", self.cliprange_value)
        check_choice("critic.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)


@dataclass(frozen=True)
class RefConfig:
    """The frozen reference policy (log-probs for the KL terms)."""

    model_path: str = knob("", "Local HF folder of the reference; empty = the actor's "
                           "initial weights.")
    log_prob_micro_batch_size_per_gpu: int = knob(8, "Sequences per reference forward on one "
                                                  "DP rank (ignored when use_dynamic_bsz).")
    log_prob_use_dynamic_bsz: bool = knob(False, "Form reference micro-batches by token budget.")
    log_prob_max_token_len_per_gpu: int = knob(16384, "Token budget of one dynamic reference "
                                               "micro-batch on one DP rank.")
    param_offload: bool = knob(False, "Keep the reference (and reward-model) weights in host "
                               "memory except during their forward.")

    def __post_init__(self) -> None:
        check_positive("ref.log_prob_micro_batch_size_per_gpu",
                       self.log_prob_micro_batch_size_per_gpu)
        check_positive("ref.log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu)
