"""The root config: one section per component plus the checks that span sections.

Contract: ``HybridRLConfig`` is the single home of every default (each section's dataclass).
Building it (directly or through ``load_config``) validates every section, then the cross-section
rules below; a violation raises ``ValueError`` naming the full keys involved. Rules that need the
world size (DP divisibility of batch sizes) run in ``check_world(world_size)``, which the trainer
calls once the world is known; they also run at construction when ``parallel.dp`` is set.
"""

from dataclasses import dataclass

from hybridrl.config._fields import section
from hybridrl.config.algorithm import AlgorithmConfig, RewardConfig
from hybridrl.config.data import DataConfig
from hybridrl.config.model import ModelConfig
from hybridrl.config.parallel import KernelsConfig, ParallelConfig, ReshardConfig
from hybridrl.config.roles import ActorConfig, CriticConfig, RefConfig, TrainedRoleConfig
from hybridrl.config.rollout import RolloutConfig
from hybridrl.config.sft import SFTConfig
from hybridrl.config.trainer import TrainerConfig


@dataclass(frozen=True)
class HybridRLConfig:
    """Everything one hybridrl run needs."""

    model: ModelConfig = section(ModelConfig, "Policy model.")
    actor: ActorConfig = section(ActorConfig, "Actor optimizer, batching and policy loss.")
    critic: CriticConfig = section(CriticConfig, "Critic (value model), used by GAE.")
    ref: RefConfig = section(RefConfig, "Frozen reference policy.")
    rollout: RolloutConfig = section(RolloutConfig, "Generation engine and sampling.")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "Advantages and in-reward KL.")
    reward: RewardConfig = section(RewardConfig, "Sequence scoring.")
    data: DataConfig = section(DataConfig, "Prompt datasets and batching.")
    trainer: TrainerConfig = section(TrainerConfig, "PPO loop cadence, checkpoints, logging.")
    parallel: ParallelConfig = section(ParallelConfig, "Training and generation layouts.")
    reshard: ReshardConfig = section(ReshardConfig, "Train -> generation weight movement.")
    kernels: KernelsConfig = section(KernelsConfig, "Compiled kernels or torch references.")
    sft: SFTConfig = section(SFTConfig, "Supervised warm start (torchrun -m hybridrl.sft).")

    def __post_init__(self) -> None:
        self._check_model_fits_layout()
        self._check_batches()
        self._check_algorithm()
        if self.parallel.dp:
            self.check_world(self.parallel.dp * self.parallel.model_parallel_size
                             + (self.parallel.gen.world if self.parallel.split else 0))

    @property
    def use_critic(self) -> bool:
        """True when the advantage estimator needs a value model (GAE)."""
        return self.algorithm.adv_estimator == "gae"

    def check_world(self, world_size: int) -> int:
        """Check the batch sizes against the DP size of ``world_size`` ranks; return that DP size."""
        dp = self.parallel.resolve_dp(self.parallel.train_world(world_size))
        n = self.rollout.n
        if (self.data.train_batch_size * n) % dp:
            raise ValueError(f"data.train_batch_size*rollout.n ({self.data.train_batch_size}*{n}) "
                             f"must be divisible by the DP size {dp}")
        for role in self._trained_roles():
            s = role.SECTION
            responses = role.ppo_mini_batch_size * n
            if responses % dp:
                raise ValueError(f"{s}.ppo_mini_batch_size*rollout.n ({role.ppo_mini_batch_size}"
                                 f"*{n}) must be divisible by the DP size {dp}")
            per_rank = responses // dp
            if not role.use_dynamic_bsz and per_rank % role.ppo_micro_batch_size_per_gpu:
                raise ValueError(
                    f"{s}.ppo_micro_batch_size_per_gpu ({role.ppo_micro_batch_size_per_gpu}) must "
                    f"divide the per-rank mini-batch {s}.ppo_mini_batch_size*rollout.n/dp = "
                    f"{role.ppo_mini_batch_size}*{n}/{dp} = {per_rank}")
        return dp

    def _trained_roles(self) -> tuple[TrainedRoleConfig, ...]:
        return (self.actor, self.critic) if self.use_critic else (self.actor,)

    def _check_model_fits_layout(self) -> None:
        m, par = self.model, self.parallel
        if m.sequence_parallel and par.tp == 1:
            raise ValueError("model.sequence_parallel needs parallel.tp > 1 (it splits the "
                             "sequence over the tensor-parallel group); got parallel.tp=1")
        if not m.is_builtin:
            return  # sizes come from the HF config.json; the model builder checks them
        for key, size in (("parallel.tp", par.tp), ("parallel.gen.tp", par.gen.tp)):
            if m.num_query_groups % size:
                raise ValueError(f"model.num_query_groups ({m.num_query_groups}) must be "
                                 f"divisible by {key} ({size})")
        for key, size in (("parallel.pp", par.pp), ("parallel.gen.pp", par.gen.pp)):
            if m.num_layers % size:
                raise ValueError(f"model.num_layers ({m.num_layers}) must be divisible by "
                                 f"{key} ({size})")
        seq = self.data.max_prompt_length + self.rollout.response_length
        if seq > m.max_position_embeddings:
            raise ValueError(
                f"data.max_prompt_length + rollout.response_length ({self.data.max_prompt_length}"
                f" + {self.rollout.response_length} = {seq}) exceeds "
                f"model.max_position_embeddings ({m.max_position_embeddings})")

    def _check_batches(self) -> None:
        total = self.data.train_batch_size
        for role in self._trained_roles():
            mini = role.ppo_mini_batch_size
            if mini > total or total % mini:
                raise ValueError(f"{role.SECTION}.ppo_mini_batch_size ({mini}) must divide "
                                 f"data.train_batch_size ({total})")

    def _check_algorithm(self) -> None:
        if self.algorithm.adv_estimator in ("grpo", "rloo") and self.rollout.n < 2:
            raise ValueError("rollout.n must be >= 2 when algorithm.adv_estimator is "
                             f"'{self.algorithm.adv_estimator}' "
                             f"(advantages are relative to the prompt's group); got {self.rollout.n}")
        if self.reward.overlong_buffer > self.rollout.response_length:
            raise ValueError(f"reward.overlong_buffer ({self.reward.overlong_buffer}) must be <= "
                             f"rollout.response_length ({self.rollout.response_length})")
        if self.algorithm.filter_groups.enable and (self.rollout.n < 2
                                                    or self.reward.reward_model_path):
            raise ValueError("algorithm.filter_groups.enable=true needs rollout.n >= 2 and a "
                             "rule / custom reward (not reward.reward_model_path); got "
                             f"rollout.n={self.rollout.n}")
        if self.reshard.strategy == "zero_redundancy":
            par = self.parallel
            if par.gen.grouping != "hybridflow" or not par.nested:
                raise ValueError(
                    "reshard.strategy 'zero_redundancy' needs parallel.gen.grouping 'hybridflow', "
                    "parallel.gen.tp dividing parallel.tp and parallel.gen.pp dividing parallel.pp;"
                    f" got grouping={par.gen.grouping!r}, tp={par.tp}, gen.tp={par.gen.tp}, "
                    f"pp={par.pp}, gen.pp={par.gen.pp} (use 'p2p' or 'auto')")
        self._check_placement()
        if self.rollout.engine == "sglang" and self.trainer.device == "cpu":
            raise ValueError("rollout.engine 'sglang' needs a GPU; trainer.device is 'cpu' "
                             "(use rollout.engine=builtin)")

    def _check_placement(self) -> None:
        split, r = self.parallel.split, self.rollout
        if r.async_steps and not split:
            raise ValueError(f"rollout.async_steps={r.async_steps} needs parallel.placement=split "
                             "(generation overlaps training only on ranks of its own)")
        if r.async_steps and self.algorithm.filter_groups.enable:
            raise ValueError(f"rollout.async_steps={r.async_steps} does not combine with "
                             "algorithm.filter_groups.enable (its rounds depend on the scores)")
        if split and r.engine == "sglang" and self.trainer.device != "cuda":
            raise ValueError("parallel.placement=split with rollout.engine=sglang needs "
                             f"trainer.device=cuda (one SGLang Engine per generation replica on "
                             f"its own GPUs); got trainer.device={self.trainer.device!r}")
        if split and self.reshard.strategy != "auto":
            raise ValueError("parallel.placement=split moves weights with the split strategy; "
                             f"reshard.strategy must be 'auto', got {self.reshard.strategy!r}")
        if self.actor.router_replay == "rollout" and (split or r.engine != "builtin"):
            raise ValueError("actor.router_replay=rollout needs the expert ids the builtin "
                             "engine records, brought to the trainer by the colocated hand-off: "
                             "use rollout.engine=builtin and parallel.placement=colocated (got "
                             f"{r.engine}, {self.parallel.placement})")
