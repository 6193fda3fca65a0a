#!/usr/bin/env bash
# PPO (GAE with a critic) on GSM8K, one node: verl's megatron GSM8K command line, run by hybridrl.
#
# The overrides below are verl's keys (examples/ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh in
# verl, sized for a 0.5B-1.5B model); hybridrl translates them and prints one notice line saying
# how (docs/from_verl.md). Needs, on local disk (nothing is downloaded):
#   MODEL_PATH  an HF folder (config.json, *.safetensors, tokenizer files) of a Llama/Qwen2 model,
#               e.g. Qwen2.5-0.5B-Instruct
#   DATA_DIR    train.parquet / test.parquet from
#               python examples/prepare_gsm8k.py --src <GSM8K parquet folder> --out data/gsm8k
# Usage: MODEL_PATH=models/Qwen2.5-0.5B-Instruct bash examples/gsm8k_ppo_megatron.sh [key=value ...]
# (extra overrides go last and win). docs/gsm8k.md walks through it and what the curve looks like.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-models/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-data/gsm8k}
NPROC=${NPROC:-8}                      # GPUs on this node
TORCHRUN=${TORCHRUN:-torchrun}

if [[ ! -f "$MODEL_PATH/config.json" ]]; then
    echo "gsm8k_ppo_megatron.sh: MODEL_PATH=$MODEL_PATH has no config.json (a local HF folder)" >&2
    exit 2
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1   # megatron: overlap TP communication with compute

$TORCHRUN --standalone --nproc-per-node "$NPROC" -m hybridrl.train \
    --config-path=./config --config-name=ppo_megatron_trainer \
    algorithm.adv_estimator=gae \
    data.train_files="['$DATA_DIR/train.parquet']" \
    data.val_files="['$DATA_DIR/test.parquet']" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1 \
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2 \
    critic.optim.lr=1e-5 \
    critic.model.path="$MODEL_PATH" \
    critic.ppo_micro_batch_size_per_gpu=4 \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='hybridrl_gsm8k' \
    trainer.experiment_name='ppo_megatron' \
    trainer.default_local_dir=outputs/ppo_megatron/checkpoints \
    trainer.n_gpus_per_node="$NPROC" \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.val_before_train=True \
    trainer.total_epochs=15 "$@"
