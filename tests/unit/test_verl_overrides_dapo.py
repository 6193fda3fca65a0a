"""verl command lines beyond the GSM8K examples: a megatron PPO script with verl's deprecated
global micro-batch sizes and the critic's gradient-checkpointing key, a DAPO recipe and a GSPO
example (recipe/dapo, examples/gspo_trainer: their overrides as the shell passes them) load as a
whole with verl's meaning; the deprecated keys' division and refusals."""

import pytest

from hybridrl.config import load_config
from hybridrl.config.verl.keys import rule_for
from hybridrl.config.verl.translate import translate_overrides

ARR = "actor_rollout_ref"

# verl (0.1-0.2) examples/ppo_trainer/run_deepseek_megatron.sh: global micro-batch sizes
VERL_PPO_MEGATRON_DEPRECATED = [
    "data.train_files=/d/gsm8k/train.parquet", "data.val_files=/d/gsm8k/test.parquet",
    "data.train_batch_size=1024", "data.val_batch_size=1312", "data.max_prompt_length=512",
    "data.max_response_length=512", f"{ARR}.model.path=deepseek-ai/deepseek-coder-1.3b-instruct",
    f"{ARR}.actor.optim.lr=2e-6", f"{ARR}.actor.ppo_mini_batch_size=256",
    f"{ARR}.actor.ppo_micro_batch_size=64",
    f"{ARR}.actor.megatron.tensor_model_parallel_size=2",
    f"{ARR}.rollout.log_prob_micro_batch_size=128",
    f"{ARR}.rollout.tensor_model_parallel_size=2", f"{ARR}.rollout.name=vllm",
    f"{ARR}.rollout.gpu_memory_utilization=0.5",
    f"{ARR}.ref.log_prob_micro_batch_size=128",
    f"{ARR}.ref.megatron.tensor_model_parallel_size=2",
    "critic.optim.lr=2e-5", "critic.model.path=deepseek-ai/deepseek-coder-1.3b-instruct",
    "critic.model.enable_gradient_checkpointing=False", "critic.ppo_micro_batch_size=64",
    "critic.megatron.tensor_model_parallel_size=2", "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.critic_warmup=0", "trainer.logger=['console']",
    "trainer.project_name=verl_megatron_gsm8k_examples",
    "trainer.experiment_name=deepseek_llm_1b3_function_rm", "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1", "trainer.save_freq=-1", "trainer.test_freq=1", "trainer.total_epochs=15",
]

# recipe/dapo (megatron variant): dynamic sampling, clip-higher, token-mean, overlong buffer
VERL_DAPO = [
    "data.train_files=/d/dapo-math-17k.parquet", "data.val_files=/d/aime-2024.parquet",
    "data.prompt_key=prompt", "data.truncation=left", "data.max_prompt_length=2048",
    "data.max_response_length=8192", "data.gen_batch_size=1536", "data.train_batch_size=512",
    f"{ARR}.rollout.n=16", "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
    "algorithm.kl_ctrl.kl_coef=0.0", f"{ARR}.actor.use_kl_loss=False",
    f"{ARR}.actor.kl_loss_coef=0.0", f"{ARR}.actor.clip_ratio_low=0.2",
    f"{ARR}.actor.clip_ratio_high=0.28", f"{ARR}.actor.clip_ratio_c=10.0",
    "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc",
    "algorithm.filter_groups.max_num_gen_batches=10",
    f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.ref.log_prob_use_dynamic_bsz=True",
    f"{ARR}.rollout.log_prob_use_dynamic_bsz=True",
    f"{ARR}.actor.ppo_max_token_len_per_gpu=20480",
    f"{ARR}.ref.log_prob_max_token_len_per_gpu=20480",
    f"{ARR}.rollout.log_prob_max_token_len_per_gpu=20480",
    f"{ARR}.model.path=/m/Qwen2.5-32B", f"{ARR}.actor.optim.lr=1e-6",
    f"{ARR}.actor.optim.lr_warmup_steps=10", f"{ARR}.actor.optim.weight_decay=0.1",
    f"{ARR}.actor.ppo_mini_batch_size=32", f"{ARR}.actor.megatron.param_offload=True",
    f"{ARR}.actor.megatron.optimizer_offload=True", f"{ARR}.actor.megatron.grad_offload=True",
    f"{ARR}.actor.megatron.pipeline_model_parallel_size=2",
    f"{ARR}.actor.megatron.tensor_model_parallel_size=4", f"{ARR}.actor.entropy_coeff=0",
    f"{ARR}.actor.optim.clip_grad=1.0", f"{ARR}.actor.loss_agg_mode=token-mean",
    f"{ARR}.rollout.gpu_memory_utilization=0.80", f"{ARR}.rollout.tensor_model_parallel_size=4",
    f"{ARR}.rollout.enable_chunked_prefill=True", f"{ARR}.rollout.max_num_batched_tokens=10240",
    f"{ARR}.rollout.temperature=1.0", f"{ARR}.rollout.top_p=1.0", f"{ARR}.rollout.top_k=-1",
    f"{ARR}.rollout.val_kwargs.temperature=1.0", f"{ARR}.rollout.val_kwargs.top_p=0.7",
    f"{ARR}.rollout.val_kwargs.top_k=-1", f"{ARR}.rollout.val_kwargs.do_sample=True",
    f"{ARR}.rollout.val_kwargs.n=1", f"{ARR}.rollout.name=vllm",
    f"{ARR}.ref.megatron.pipeline_model_parallel_size=2",
    f"{ARR}.ref.megatron.tensor_model_parallel_size=4", f"{ARR}.ref.megatron.param_offload=True",
    "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
    "reward_model.overlong_buffer.len=4096", "reward_model.overlong_buffer.penalty_factor=1.0",
    "trainer.logger=['console','wandb']", "trainer.project_name=DAPO",
    "trainer.experiment_name=DAPO-Qwen2.5-32B-megatron", "trainer.n_gpus_per_node=8",
    "trainer.nnodes=2", "trainer.val_before_train=True", "trainer.test_freq=5",
    "trainer.save_freq=5", "trainer.total_epochs=1", "trainer.resume_mode=auto",
]

# examples/gspo_trainer (megatron): sequence-level ratio, the paper's clip ranges
VERL_GSPO = [
    "algorithm.adv_estimator=grpo", "data.train_files=/d/dapo-math-17k.parquet",
    "data.val_files=/d/aime-2024.parquet", "data.train_batch_size=256",
    "data.max_prompt_length=2048", "data.max_response_length=8192",
    "data.filter_overlong_prompts=True", "data.truncation=error",
    f"{ARR}.model.path=/m/Qwen3-8B", f"{ARR}.actor.optim.lr=1e-6",
    f"{ARR}.actor.policy_loss.loss_mode=gspo", f"{ARR}.actor.clip_ratio_low=0.0003",
    f"{ARR}.actor.clip_ratio_high=0.0004", f"{ARR}.actor.loss_agg_mode=seq-mean-token-mean",
    f"{ARR}.actor.ppo_mini_batch_size=64", f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2",
    f"{ARR}.actor.use_kl_loss=False", f"{ARR}.actor.kl_loss_coef=0.0",
    "algorithm.use_kl_in_reward=False", f"{ARR}.actor.megatron.tensor_model_parallel_size=2",
    f"{ARR}.actor.megatron.pipeline_model_parallel_size=1",
    f"{ARR}.rollout.tensor_model_parallel_size=2", f"{ARR}.rollout.name=vllm",
    f"{ARR}.rollout.n=8", f"{ARR}.rollout.gpu_memory_utilization=0.7",
    f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=4",
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=2.0",
    f"{ARR}.ref.megatron.tensor_model_parallel_size=2",
    "trainer.logger=['console']", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
    "trainer.total_epochs=10", "trainer.save_freq=-1", "trainer.test_freq=10",
]


def test_megatron_ppo_with_deprecated_global_micro_batches_loads():
    notices = []
    cfg = load_config([], VERL_PPO_MEGATRON_DEPRECATED, world_size=8, notices=notices)
    # DP = 8 GPUs / tp 2 = 4: 64 -> 16 per GPU, 128 -> 32 (verl's megatron worker divides by DP)
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 16
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 16
    assert cfg.ref.log_prob_micro_batch_size_per_gpu == 32
    assert cfg.model.recompute_granularity == "none" and cfg.parallel.tp == 2
    assert f"{ARR}.actor.ppo_micro_batch_size=64 -> actor.ppo_micro_batch_size_per_gpu=16 " \
           "(/ DP 4)" in notices[0]


def test_dapo_recipe_loads_as_a_whole():
    cfg = load_config([], VERL_DAPO, world_size=16)
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.max_num_gen_batches == 10
    assert (cfg.reward.overlong_buffer, cfg.reward.overlong_penalty_factor) == (4096, 1.0)
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.28)
    assert cfg.actor.loss_agg_mode == "token-mean" and cfg.rollout.n == 16
    assert (cfg.parallel.tp, cfg.parallel.pp) == (4, 2) and cfg.check_world(16) == 2


def test_gspo_example_loads_as_a_whole():
    cfg = load_config([], VERL_GSPO, world_size=8)
    assert cfg.actor.policy_loss == "gspo" and cfg.actor.loss_agg_mode == "seq-mean-token-mean"
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (3e-4, 4e-4)
    assert (cfg.actor.rollout_is, cfg.actor.rollout_is_cap) == ("token", 2.0)


@pytest.mark.parametrize("item", sorted(set(VERL_PPO_MEGATRON_DEPRECATED + VERL_DAPO + VERL_GSPO)))
def test_each_override_is_listed(item):
    key = item.split("=", 1)[0]
    assert rule_for(key) is not None, f"{key} missing from VERL_RULES"
    if item != "reward_model.overlong_buffer.enable=True":  # alone it needs the buffer's len
        assert translate_overrides([item]).problems == []


def _fails(overrides, *fragments, **kwargs):
    with pytest.raises(ValueError) as info:
        load_config([], list(overrides), **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


def test_global_micro_batch_refusals(tmp_path):
    _fails([f"{ARR}.actor.ppo_micro_batch_size=64",
            f"{ARR}.actor.ppo_micro_batch_size_per_gpu=4"], "give one")
    _fails([f"{ARR}.actor.ppo_micro_batch_size=4"], "leaves no sequence per GPU")  # 4 // 8
    # a layout override on the command line is seen: tp 2 on 8 GPUs -> DP 4, 64 -> 16
    cfg = load_config([], [f"{ARR}.actor.ppo_micro_batch_size=64", "parallel.tp=2",
                           "model.path=/m"], world_size=8)
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 16
    # verl's keys say DP 8; a YAML layout with tp 2 on 8 ranks has DP 4: refused
    yaml = tmp_path / "tp2.yaml"
    yaml.write_text("model:\n  path: /m\nparallel:\n  tp: 2\n")
    with pytest.raises(ValueError, match="divided by DP 8 .* this layout has DP 4"):
        load_config([str(yaml)], [f"{ARR}.actor.ppo_micro_batch_size=64"], world_size=8)


def test_critic_checkpointing_must_agree_with_the_actor():
    _fails([f"{ARR}.model.enable_gradient_checkpointing=True",
            "critic.model.enable_gradient_checkpointing=False"], "one recompute setting")
    cfg = load_config([], ["critic.model.enable_gradient_checkpointing=True"])
    assert cfg.model.recompute_granularity == "full"


def test_reference_layout_other_than_the_actors_is_refused():
    _fails([f"{ARR}.actor.megatron.pipeline_model_parallel_size=2",
            f"{ARR}.ref.megatron.pipeline_model_parallel_size=4", "model.path=/m"],
           "actor's layout", "parallel.pp=2")


def test_overlong_enable_without_len_and_disabled():
    _fails(["reward_model.overlong_buffer.enable=True"], "overlong_buffer.len")
    cfg = load_config([], ["reward_model.overlong_buffer.len=64",
                           "reward_model.overlong_buffer.enable=False"])
    assert cfg.reward.overlong_buffer == 0
