"""Algorithm and reward sections: advantage estimator, KL control and the reward function.

Contract: ``AlgorithmConfig`` picks the advantage estimator (``gae`` trains a critic, ``grpo``
normalizes within each prompt's group) and where the KL to the reference enters (in the reward
through ``kl_ctrl``, and/or as a loss term via ``actor.use_kl_loss``). ``RewardConfig`` picks how
sequences are scored. Both validate in ``__post_init__`` with the full key in every message.
"""

from dataclasses import dataclass
from typing import Any

from hybridrl.config._fields import (
    check_choice,
    check_non_negative,
    check_positive,
    check_range,
    knob,
    section,
)
from hybridrl.config.roles import KL_KINDS

ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus",
                  "reinforce_plus_plus_baseline")  # hybridrl.algos's registered ones
KL_CTRL_TYPES = ("fixed", "adaptive")
GSM8K_METHODS = ("strict", "flexible")


@dataclass(frozen=True)
class KLCtrlConfig:
    """Controller of the in-reward KL coefficient beta."""

    type: str = knob("fixed", "fixed (beta = kl_coef forever) | adaptive (beta *= 1 + "
                     "clip(kl/target_kl - 1, -0.2, 0.2) * n_steps/horizon).")
    kl_coef: float = knob(0.001, "Initial (or fixed) beta.")
    target_kl: float = knob(0.1, "Adaptive controller: KL the controller steers toward.")
    horizon: int = knob(10000, "Adaptive controller: horizon (in samples) of the update.")

    def __post_init__(self) -> None:
        check_choice("algorithm.kl_ctrl.type", self.type, KL_CTRL_TYPES)
        check_non_negative("algorithm.kl_ctrl.kl_coef", self.kl_coef)
        check_positive("algorithm.kl_ctrl.target_kl", self.target_kl)
        check_positive("algorithm.kl_ctrl.horizon", self.horizon)


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop prompt groups whose scores are all equal, generate more."""

    enable: bool = knob(False, "Keep generating until the batch holds data.train_batch_size "
                        "prompt groups whose sequence scores are not all equal (groups with "
                        "zero score std teach nothing to grpo-like estimators); needs "
                        "rollout.n >= 2 and a rule / custom reward; at dp > 1 the kept rows "
                        "are re-balanced over the DP replicas "
                        "(hybridrl.trainer.dynamic_sampling).")
    max_num_gen_batches: int = knob(10, "Most generation rounds per step (>= 1); when they "
                                    "end short, the batch is filled with uninformative groups.")

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_gen_batches, int) or self.max_num_gen_batches < 1:
            raise ValueError("algorithm.filter_groups.max_num_gen_batches must be an integer "
                             f">= 1 (rounds are bounded); got {self.max_num_gen_batches!r}")


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantage estimation and the in-reward KL penalty."""

    adv_estimator: str = knob("gae", "Advantage estimator: gae (critic + GAE) | grpo "
                              "(group-relative, no critic) | rloo (leave-one-out, no critic) | "
                              "reinforce_plus_plus (discounted return, whitened, no critic) | "
                              "reinforce_plus_plus_baseline (score minus its group's mean, "
                              "whitened, no critic) | "
                              "a name registered with hybridrl.algos.register_advantage_estimator "
                              "(no critic; looked up when advantages are computed).")
    gamma: float = knob(1.0, "GAE discount factor.")
    lam: float = knob(1.0, "GAE lambda.")
    norm_adv_by_std_in_grpo: bool = knob(True, "GRPO: divide by the group's std (false = "
                                         "Dr.GRPO, mean-centering only).")
    use_kl_in_reward: bool = knob(False, "Subtract beta * KL(actor || ref) from token rewards.")
    kl_penalty: str = knob("kl", "KL estimator of the in-reward penalty (same names as "
                           "actor.kl_loss_type).")
    kl_ctrl: KLCtrlConfig = section(KLCtrlConfig, "In-reward KL coefficient controller.")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO dynamic sampling.")

    def __post_init__(self) -> None:
        if not self.adv_estimator:  # other names: user estimators, checked by the registry
            raise ValueError("algorithm.adv_estimator must name an estimator: "
                             f"{' | '.join(ADV_ESTIMATORS)} or a registered one; got ''")
        check_range("algorithm.gamma", self.gamma, 0.0, 1.0)
        check_range("algorithm.lam", self.lam, 0.0, 1.0)
        check_choice("algorithm.kl_penalty", self.kl_penalty, KL_KINDS)


@dataclass(frozen=True)
class RewardConfig:
    """Sequence scoring: builtin scorers by data_source, a user function or a reward model."""

    reward_fn: str = knob("", "User scorer as 'package.module:function' or "
                          "'path/to/file.py:function', with verl's signature "
                          "(data_source, solution_str, ground_truth, extra_info); empty = the "
                          "builtin scorer registered for each sample's data_source.")
    reward_fn_kwargs: dict[str, Any] = knob({}, "Extra keyword arguments passed to reward_fn on "
                                            "every call.")
    reward_model_path: str = knob("", "Local HF folder of a reward model (critic architecture, "
                                  "score at the last response token); empty = none.")
    gsm8k_method: str = knob("strict", "GSM8K answer extraction: strict ('#### N') | flexible "
                             "(last number).")
    format_score: float = knob(0.0, "Arithmetic task: score of a well-formed but wrong answer.")
    use_length_penalty: bool = knob(False, "Add length_penalty_weight * min(response "
                                    "tokens / rollout.response_length, 1) to each score.")
    length_penalty_weight: float = knob(-0.05, "Weight of the length penalty (<= 0).")
    use_repetition_penalty: bool = knob(False, "Add repetition_penalty_weight * (fraction "
                                        "of repeated 3-grams in the response) to each score.")
    repetition_penalty_weight: float = knob(-0.05, "Weight of the repetition penalty (<= 0).")
    overlong_buffer: int = knob(0, "DAPO overlong shaping: the last this-many tokens of "
                                "rollout.response_length are a buffer; a response of n tokens "
                                "gets min(-(n - (response_length - buffer)) / buffer * "
                                "overlong_penalty_factor, 0) added to its score. 0 = off.")
    overlong_penalty_factor: float = knob(1.0, "Penalty at the full length (>= 0).")
    timeout_s: float = knob(60.0, "Seconds one reward-function call may take; a timeout (or an "
                            "exception) stops every rank with one line naming the function, "
                            "the data_source and the row. 0 = no limit.")
    num_workers: int = knob(0, "Processes scoring each rank's rows in parallel (a forkserver "
                            "pool rebuilt from this section: use reward_fn, not run-time "
                            "registrations); 0 = in the rank's own process.")

    def __post_init__(self) -> None:
        if self.reward_fn:
            module, _, func = self.reward_fn.partition(":")
            if not module or not func:
                raise ValueError("reward.reward_fn must look like 'package.module:function' or "
                                 "'path/to/file.py:function'; "
                                 f"got {self.reward_fn!r}")
        if self.reward_fn_kwargs and not self.reward_fn:
            raise ValueError("reward.reward_fn_kwargs is set but reward.reward_fn is empty")
        if self.reward_fn and self.reward_model_path:
            raise ValueError("set at most one of reward.reward_fn and reward.reward_model_path")
        check_choice("reward.gsm8k_method", self.gsm8k_method, GSM8K_METHODS)
        check_range("reward.format_score", self.format_score, 0.0, 1.0)
        if not self.timeout_s >= 0 or self.timeout_s == float("inf"):  # nan fails >= too
            raise ValueError("reward.timeout_s must be a finite number >= 0 (0 = no limit); got "
                             f"{self.timeout_s!r}")
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"reward.num_workers must be an integer >= 0; got {self.num_workers!r}")
        if not isinstance(self.overlong_buffer, int) or self.overlong_buffer < 0:
            raise ValueError("reward.overlong_buffer must be an integer >= 0 (0 = off); "
                             f"got {self.overlong_buffer!r}")
        check_non_negative("reward.overlong_penalty_factor", self.overlong_penalty_factor)
        for name in ("length_penalty_weight", "repetition_penalty_weight"):
            if getattr(self, name) > 0:
                raise ValueError(f"reward.{name} must be <= 0 (it is a penalty); "
                                 f"got {getattr(self, name)!r}")
