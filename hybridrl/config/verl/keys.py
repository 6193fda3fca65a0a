"""verl's config keys and what each one means in hybridrl (a hand-written, checked table).

Contract: ``VERL_RULES`` is an immutable tuple of ``VerlRule``, one per verl key (its Hydra path).
A rule's ``kind`` says what an override of that key does:

- ``set``: the value (after ``values``, a verl-value -> hybridrl-value table) goes to every key in
  ``ours``; ``ours == (verl,)`` for keys spelt the same in both.
- ``ignore``: accepted with no effect when the value is in ``accept`` (any value when ``accept`` is
  empty), because hybridrl already behaves that way; another value is refused with ``note``.
- ``refuse``: no hybridrl meaning; ``note`` says what to use instead.
- ``same``: hybridrl has one knob for both (the reference runs on the actor's layout): accepted
  when the value equals the final value of ``ours[0]``, else refused with ``note``.
- ``world``: a factor of the world size (``trainer.n_gpus_per_node`` x ``trainer.nnodes``), checked
  against the launcher's world by ``load_config(..., world_size=N)``.
- ``special``: handled by name in ``hybridrl.config.verl.translate`` (``note`` says how).

``VERL_KEYS`` is the same table as ``(verl_key, hybridrl_keys, note)`` triples (rendered into
docs/config.md); ``rule_for(key)`` looks a key up. Every hybridrl key named here exists (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARR = "actor_rollout_ref"
VERL_BASE_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer")  # verl's --config-name values
VERL_WORLD_DEFAULTS = {"trainer.n_gpus_per_node": 8, "trainer.nnodes": 1}


@dataclass(frozen=True)
class VerlRule:
    """What one verl key means here (see the module docstring)."""

    verl: str
    ours: tuple[str, ...] = ()
    note: str = ""
    kind: str = "set"
    values: tuple[tuple[Any, Any], ...] = ()
    accept: tuple[Any, ...] = ()


def _set(verl: str, *ours: str, note: str = "", values: tuple = ()) -> VerlRule:
    return VerlRule(verl, ours or (verl,), note, "set", values)


def _ident(verl: str) -> VerlRule:
    return _set(verl)


def _ignore(verl: str, note: str, accept: tuple = ()) -> VerlRule:
    return VerlRule(verl, (), note, "ignore", (), accept)


def _refuse(verl: str, note: str) -> VerlRule:
    return VerlRule(verl, (), note, "refuse")


_OTC = "megatron.override_transformer_config"
_MT = f"{ARR}.rollout.multi_turn"
_ACTOR_LAYOUT = "the reference runs on the actor's layout; must equal the actor's {}"
_GLOBAL_MICRO = ("deprecated global micro-batch size: divided by the DP size (verl's megatron "
                 "workers: world / (tp x pp x cp), world = trainer.n_gpus_per_node x "
                 "trainer.nnodes) into the *_per_gpu key; giving both is refused, as in verl")

VERL_RULES: tuple[VerlRule, ...] = (
    # ---- model
    _set(f"{ARR}.model.path", "model.path", note="a local HF folder (no hub download)"),
    _ignore(f"{ARR}.model.use_fused_kernels", "hybridrl's fused KL/GAE kernels run whenever "
            "they are built (kernels.use_compiled=auto)"),
    _ignore(f"{ARR}.model.trust_remote_code", "HF folders load without remote code", (False,)),
    _set(f"{ARR}.model.enable_gradient_checkpointing", "model.recompute_granularity",
         note="true = full recompute (model.recompute_method/num_layers refine it)",
         values=((True, "full"), (False, "none"))),
    _refuse(f"{ARR}.model.lora", "LoRA is not supported: hybridrl trains full weights"),
    _ignore(f"{ARR}.model.lora_rank", "LoRA is not supported: hybridrl trains full weights "
            "(0 = no LoRA, verl's default)", (0,)),
    _ignore(f"{ARR}.model.lora_alpha", "LoRA is not supported (lora_rank must be 0)"),
    _ignore(f"{ARR}.model.lora_adapter_path", "LoRA is not supported: hybridrl trains full "
            "weights", (None, "")),
    # ---- actor optimizer, batching, loss
    _set(f"{ARR}.actor.optim.lr", "actor.lr"),
    VerlRule(f"{ARR}.actor.optim.lr_warmup_steps", ("actor.warmup_steps",),
             "-1 (verl: use the ratio) = no warmup; n > 0 also picks actor.lr_schedule=warmup "
             "unless a scheduler type is given", "special"),
    _ignore(f"{ARR}.actor.optim.lr_warmup_steps_ratio", "a warmup ratio has no counterpart; "
            "give actor.warmup_steps (optimizer steps) instead", (0, 0.0)),
    _set(f"{ARR}.actor.optim.lr_scheduler_type", "actor.lr_schedule",
         note="constant | cosine (constant with warmup steps = ours 'warmup')"),
    _set(f"{ARR}.actor.optim.min_lr_ratio", "actor.min_lr_ratio"),
    _set(f"{ARR}.actor.optim.weight_decay", "actor.weight_decay"),
    _set(f"{ARR}.actor.optim.betas", "actor.adam_betas"),
    _set(f"{ARR}.actor.optim.clip_grad", "actor.grad_clip"),
    _set(f"{ARR}.actor.grad_clip", "actor.grad_clip"),
    _set(f"{ARR}.actor.ppo_epochs", "actor.ppo_epochs"),
    _set(f"{ARR}.actor.ppo_mini_batch_size", "actor.ppo_mini_batch_size",
         note="same unit: prompts, before multiplying by rollout.n"),
    _set(f"{ARR}.actor.ppo_micro_batch_size_per_gpu", "actor.ppo_micro_batch_size_per_gpu"),
    VerlRule(f"{ARR}.actor.ppo_micro_batch_size", ("actor.ppo_micro_batch_size_per_gpu",),
             _GLOBAL_MICRO, "special"),
    _set(f"{ARR}.actor.use_dynamic_bsz", "actor.use_dynamic_bsz"),
    _set(f"{ARR}.actor.ppo_max_token_len_per_gpu", "actor.ppo_max_token_len_per_gpu"),
    _set(f"{ARR}.actor.clip_ratio", "actor.clip_ratio_low", "actor.clip_ratio_high",
         note="sets both bounds"),
    _set(f"{ARR}.actor.clip_ratio_low", "actor.clip_ratio_low"),
    _set(f"{ARR}.actor.clip_ratio_high", "actor.clip_ratio_high"),
    _set(f"{ARR}.actor.clip_ratio_c", "actor.clip_ratio_c"),
    _set(f"{ARR}.actor.loss_agg_mode", "actor.loss_agg_mode"),
    _set(f"{ARR}.actor.policy_loss.loss_mode", "actor.policy_loss"),
    _set(f"{ARR}.actor.entropy_coeff", "actor.entropy_coeff"),
    _set(f"{ARR}.actor.use_kl_loss", "actor.use_kl_loss"),
    _set(f"{ARR}.actor.kl_loss_coef", "actor.kl_loss_coef"),
    _set(f"{ARR}.actor.kl_loss_type", "actor.kl_loss_type", note="no 'full' estimator"),
    # ---- actor megatron layout
    _set(f"{ARR}.actor.megatron.tensor_model_parallel_size", "parallel.tp"),
    _set(f"{ARR}.actor.megatron.pipeline_model_parallel_size", "parallel.pp"),
    _set(f"{ARR}.actor.megatron.context_parallel_size", "parallel.cp", note="must be 1"),
    _set(f"{ARR}.actor.megatron.expert_model_parallel_size", "parallel.ep",
         note="MoE models (Qwen3-MoE); 1 for dense"),
    _set(f"{ARR}.actor.megatron.expert_tensor_parallel_size", "parallel.etp",
         note="null -> 0 (= parallel.tp)", values=((None, 0),)),
    _ignore(f"{ARR}.actor.megatron.virtual_pipeline_model_parallel_size",
            "interleaved pipelines are not supported (null or 1)", (None, 1)),
    _set(f"{ARR}.actor.megatron.param_offload", "actor.param_offload"),
    _set(f"{ARR}.actor.megatron.grad_offload", "actor.grad_offload"),
    _set(f"{ARR}.actor.megatron.optimizer_offload", "actor.optimizer_offload"),
    _set(f"{ARR}.actor.megatron.use_distributed_optimizer", "actor.use_distributed_optimizer",
         "critic.use_distributed_optimizer", note="megatron's DistributedOptimizer (both roles)"),
    _set(f"{ARR}.actor.megatron.sequence_parallel", "model.sequence_parallel",
         note="needs tp > 1"),
    _set(f"{ARR}.actor.{_OTC}.recompute_granularity", "model.recompute_granularity"),
    _set(f"{ARR}.actor.{_OTC}.recompute_method", "model.recompute_method"),
    _set(f"{ARR}.actor.{_OTC}.recompute_num_layers", "model.recompute_num_layers"),
    _ignore(f"{ARR}.actor.megatron.use_mbridge", "HF <-> megatron conversion is built in "
            "(hybridrl.models.hf_io)"),
    _ignore(f"{ARR}.actor.megatron.use_dist_checkpointing", "initial weights come from "
            "model.path (an HF folder); false is the only value", (False,)),
    _refuse(f"{ARR}.actor.megatron.override_transformer_config",
            "megatron TransformerConfig overrides are not passed through; hybridrl builds the "
            "config from the HF config.json"),
    # ---- reference
    VerlRule(f"{ARR}.ref.megatron.tensor_model_parallel_size", ("parallel.tp",),
             _ACTOR_LAYOUT.format("parallel.tp"), "same"),
    VerlRule(f"{ARR}.ref.megatron.pipeline_model_parallel_size", ("parallel.pp",),
             _ACTOR_LAYOUT.format("parallel.pp"), "same"),
    VerlRule(f"{ARR}.ref.megatron.context_parallel_size", ("parallel.cp",),
             _ACTOR_LAYOUT.format("parallel.cp"), "same"),
    VerlRule(f"{ARR}.ref.megatron.expert_model_parallel_size", ("parallel.ep",),
             _ACTOR_LAYOUT.format("parallel.ep"), "same"),
    VerlRule(f"{ARR}.ref.megatron.expert_tensor_parallel_size", ("parallel.etp",),
             _ACTOR_LAYOUT.format("parallel.etp"), "same"),
    _set(f"{ARR}.ref.megatron.param_offload", "ref.param_offload"),
    _ignore(f"{ARR}.ref.megatron.use_dist_checkpointing", "the reference starts from "
            "ref.model_path or the actor's initial weights", (False,)),
    _set(f"{ARR}.ref.log_prob_micro_batch_size_per_gpu", "ref.log_prob_micro_batch_size_per_gpu"),
    VerlRule(f"{ARR}.ref.log_prob_micro_batch_size", ("ref.log_prob_micro_batch_size_per_gpu",),
             _GLOBAL_MICRO, "special"),
    _set(f"{ARR}.ref.log_prob_use_dynamic_bsz", "ref.log_prob_use_dynamic_bsz"),
    _set(f"{ARR}.ref.log_prob_max_token_len_per_gpu", "ref.log_prob_max_token_len_per_gpu"),
    # ---- rollout
    _set(f"{ARR}.rollout.name", "rollout.engine",
         note="vllm -> sglang (hybridrl's GPU engine), hf -> builtin",
         values=(("vllm", "sglang"), ("hf", "builtin"))),
    _ignore(f"{ARR}.rollout.mode", "rollouts run in-process on the training GPUs (colocated, "
            "synchronous); sync and async give the same samples"),
    _set(f"{ARR}.rollout.n", "rollout.n"),
    _set(f"{ARR}.rollout.temperature", "rollout.temperature"),
    _set(f"{ARR}.rollout.top_p", "rollout.top_p"),
    _set(f"{ARR}.rollout.top_k", "rollout.top_k", note="-1 = off"),
    _set(f"{ARR}.rollout.response_length", "rollout.response_length"),
    _set(f"{ARR}.rollout.val_kwargs.temperature", "rollout.val_temperature"),
    _ignore(f"{ARR}.rollout.val_kwargs.do_sample", "validation samples at "
            "rollout.val_temperature (0 = greedy)"),
    _ignore(f"{ARR}.rollout.val_kwargs.n", "one validation response per prompt", (1,)),
    _set(f"{ARR}.rollout.val_kwargs.top_p", "rollout.top_p",
         note="one top_p for training and validation"),
    _set(f"{ARR}.rollout.val_kwargs.top_k", "rollout.top_k",
         note="one top_k for training and validation"),
    _set(f"{ARR}.rollout.tensor_model_parallel_size", "parallel.gen.tp"),
    _set(f"{ARR}.rollout.gpu_memory_utilization", "rollout.engine_kwargs.mem_fraction_static",
         note="SGLang's name for the same fraction"),
    _set(f"{ARR}.rollout.enforce_eager", "rollout.engine_kwargs.disable_cuda_graph",
         note="SGLang's name for eager mode"),
    _set(f"{ARR}.rollout.max_num_batched_tokens", "rollout.engine_kwargs.chunked_prefill_size",
         note="SGLang's prefill chunk"),
    _ignore(f"{ARR}.rollout.enable_chunked_prefill", "SGLang chunks prefill by default "
            "(rollout.engine_kwargs.chunked_prefill_size)"),
    _ignore(f"{ARR}.rollout.free_cache_engine", "the engine's memory is released between phases "
            "by the engine adapter"),
    _set(f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu",
         "ref.log_prob_micro_batch_size_per_gpu",
         note="old log-probs and reference log-probs share the ref section's batching"),
    VerlRule(f"{ARR}.rollout.log_prob_micro_batch_size",
             ("ref.log_prob_micro_batch_size_per_gpu",), _GLOBAL_MICRO, "special"),
    _set(f"{ARR}.rollout.log_prob_use_dynamic_bsz", "ref.log_prob_use_dynamic_bsz",
         note="shared with the reference forward"),
    _set(f"{ARR}.rollout.log_prob_max_token_len_per_gpu", "ref.log_prob_max_token_len_per_gpu",
         note="shared with the reference forward"),
    # ---- multi-turn rollouts with tools (hybridrl.rollout.multi_turn)
    _set(f"{_MT}.enable", "rollout.multi_turn.enable"),
    _set(f"{_MT}.max_assistant_turns", "rollout.multi_turn.max_assistant_turns",
         note="a number >= 1 (verl's null, no limit, is refused: the loop is always bounded)"),
    _set(f"{_MT}.format", "rollout.multi_turn.format",
         note="hermes | llama3_json as in verl; also plain and auto"),
    _set(f"{_MT}.max_tool_response_length", "rollout.multi_turn.max_tool_response_chars",
         note="characters; longer output is cut at its end"),
    _ignore(f"{_MT}.tool_response_truncate_side", "tool output is cut at its end", ("right",)),
    _refuse(f"{_MT}.tool_config_path", "verl's tool classes (async create/execute/release, "
            "their YAML schema) are not hybridrl tools: list hybridrl tools in "
            "rollout.multi_turn.tools (calculator, python, package.module:attr)"),
    _refuse(f"{_MT}.max_user_turns", "no simulated user turns: tool outputs are bounded by "
            "rollout.multi_turn.max_tool_calls"),
    _refuse(f"{_MT}.max_parallel_calls", "every call of a turn runs (up to "
            "rollout.multi_turn.max_tool_calls per sequence); rollout.multi_turn."
            "max_parallel_calls is threads per round, another meaning"),
    _refuse(f"{_MT}.interaction_config_path", "no interaction agents (simulated users)"),
    # ---- critic
    _set("critic.optim.lr", "critic.lr"),
    _set("critic.optim.lr_scheduler_type", "critic.lr_schedule"),
    _set("critic.optim.weight_decay", "critic.weight_decay"),
    _set("critic.optim.clip_grad", "critic.grad_clip"),
    _set("critic.model.path", "critic.model_path"),
    _ident("critic.cliprange_value"),
    _ident("critic.ppo_micro_batch_size_per_gpu"),
    VerlRule("critic.ppo_micro_batch_size", ("critic.ppo_micro_batch_size_per_gpu",),
             _GLOBAL_MICRO, "special"),
    VerlRule("critic.model.enable_gradient_checkpointing", ("model.recompute_granularity",),
             "one recompute setting for every role: true = full, false = none; must agree "
             f"with {ARR}.model.enable_gradient_checkpointing when both are given", "special"),
    _ident("critic.ppo_mini_batch_size"),
    _ident("critic.ppo_epochs"),
    _ident("critic.use_dynamic_bsz"),
    _ident("critic.ppo_max_token_len_per_gpu"),
    _ident("critic.loss_agg_mode"),
    VerlRule("critic.megatron.tensor_model_parallel_size", ("parallel.tp",),
             "the critic runs on the actor's layout; must equal parallel.tp", "same"),
    VerlRule("critic.megatron.pipeline_model_parallel_size", ("parallel.pp",),
             "the critic runs on the actor's layout; must equal parallel.pp", "same"),
    _set("critic.megatron.param_offload", "critic.param_offload"),
    _set("critic.megatron.grad_offload", "critic.grad_offload"),
    _set("critic.megatron.optimizer_offload", "critic.optimizer_offload"),
    # ---- algorithm
    _ident("algorithm.adv_estimator"),
    _ident("algorithm.gamma"),
    _ident("algorithm.lam"),
    _ident("algorithm.norm_adv_by_std_in_grpo"),
    _ident("algorithm.use_kl_in_reward"),
    _ident("algorithm.kl_penalty"),
    _ident("algorithm.kl_ctrl.type"),
    _ident("algorithm.kl_ctrl.kl_coef"),
    _ident("algorithm.kl_ctrl.target_kl"),
    _ident("algorithm.kl_ctrl.horizon"),
    _ident("algorithm.filter_groups.enable"),
    _ident("algorithm.filter_groups.max_num_gen_batches"),
    _ignore("algorithm.filter_groups.metric", "groups are filtered on the sequence score (the "
            "reward function's score plus shaping: verl's seq_final_reward without in-reward "
            "KL; acc for 0/1 rule rewards)", ("acc", "score", "seq_reward", "seq_final_reward")),
    _set("algorithm.rollout_correction.rollout_is", "actor.rollout_is",
         note="token | sequence; null = off", values=((None, ""),)),
    _set("algorithm.rollout_correction.rollout_is_threshold", "actor.rollout_is_cap"),
    # ---- reward
    _set("reward_model.model.path", "reward.reward_model_path", note="set = enabled"),
    _ignore("reward_model.enable", "a reward model is used exactly when "
            "reward.reward_model_path is set", (False,)),
    _ignore("reward_model.reward_manager", "scores are computed once per sequence by "
            "hybridrl.rewards (verl's 'naive' manager; 'dapo' = naive + reward.overlong_buffer)",
            ("naive", "dapo")),
    VerlRule("reward_model.overlong_buffer.enable", ("reward.overlong_buffer",),
             "false = reward.overlong_buffer=0; true needs reward_model.overlong_buffer.len",
             "special"),
    _set("reward_model.overlong_buffer.len", "reward.overlong_buffer"),
    _set("reward_model.overlong_buffer.penalty_factor", "reward.overlong_penalty_factor"),
    _ignore("reward_model.overlong_buffer.log", "reward/overlong_penalty/mean is always logged "
            "when the buffer is on"),
    _refuse("custom_reward_function.path", "give reward.reward_fn='path/to/file.py:function' "
            "(one key: the file and the function name)"),
    _refuse("custom_reward_function.name", "give reward.reward_fn='path/to/file.py:function'"),
    _set("custom_reward_function.reward_kwargs", "reward.reward_fn_kwargs"),
    # ---- data
    _ident("data.train_files"),
    _ident("data.val_files"),
    _ident("data.prompt_key"),
    _ident("data.max_prompt_length"),
    _set("data.max_response_length", "rollout.response_length"),
    _ident("data.truncation"),
    VerlRule("data.filter_overlong_prompts", ("data.truncation",),
             "true = data.truncation=drop (applied after data.truncation, as verl filters "
             "before truncating)", "special"),
    _ident("data.train_batch_size"),
    _set("data.val_batch_size", "data.val_batch_size"),
    _ident("data.shuffle"),
    _ident("data.seed"),
    _ignore("data.return_raw_chat", "prompts are tokenized once with the chat template; the "
            "engine receives token ids"),
    _ignore("data.gen_batch_size", "each generation round takes data.train_batch_size prompts "
            "(algorithm.filter_groups bounds the rounds)"),
    _ignore("data.trust_remote_code", "tokenizers load without remote code", (False,)),
    # ---- trainer
    _ident("trainer.total_epochs"),
    VerlRule("trainer.total_training_steps", ("trainer.total_steps",), "null -> 0 (use "
             "total_epochs)", "set", ((None, 0),)),
    _ident("trainer.save_freq"),
    _ident("trainer.test_freq"),
    _ident("trainer.val_before_train"),
    _set("trainer.default_local_dir", "trainer.checkpoint_dir", note="checkpoints only (verl's "
         "default: checkpoints/<project_name>/<experiment_name>); unset, they go to "
         "<output_dir>/<experiment_name>/checkpoints; config, metrics and generations always "
         "go to the run folder <trainer.output_dir>/<trainer.experiment_name>"),
    _set("trainer.resume_mode", "trainer.resume", note="auto | disable | resume_path (-> path)",
         values=(("resume_path", "path"),)),
    _set("trainer.resume_from_path", "trainer.resume_path"),
    VerlRule("trainer.logger", ("trainer.logger",), "wandb, mlflow, tensorboard are kept; sinks "
             "hybridrl lacks (swanlab, clearml, ...) are replaced by jsonl "
             "(<output_dir>/<experiment_name>/metrics.jsonl)", "special"),
    _ident("trainer.project_name"),
    _set("trainer.experiment_name", note="also the run folder's name under trainer.output_dir"),
    _ignore("trainer.critic_warmup", "no critic-only warm-up phase: the actor and critic both "
            "update from step 1; drop the key or set 0", (0,)),
    _ignore("trainer.balance_batch", "DP shares are contiguous; dynamic batching "
            "(*.use_dynamic_bsz) balances tokens within a rank"),
    _ignore("trainer.log_val_generations", "validation logs the score only"),
    VerlRule("trainer.n_gpus_per_node", (), "with trainer.nnodes: checked against the "
             "launcher's world size (torchrun sets it)", "world"),
    VerlRule("trainer.nnodes", (), "with trainer.n_gpus_per_node: checked against the "
             "launcher's world size (torchrun sets it)", "world"),
    _refuse("actor_rollout_ref.hybrid_engine", "hybridrl is always a hybrid engine (train and "
            "rollout colocated)"),
)

VERL_KEYS: tuple[tuple[str, tuple[str, ...], str], ...] = tuple(
    (r.verl, r.ours, r.note) for r in VERL_RULES)


def rule_for(verl_key: str) -> VerlRule | None:
    """The rule of ``verl_key``, or of the nearest listed prefix for a ``refuse`` family
    (``...override_transformer_config.X`` -> its parent's rule); None when not listed."""
    for rule in VERL_RULES:
        if rule.verl == verl_key:
            return rule
    for rule in VERL_RULES:
        if rule.kind == "refuse" and verl_key.startswith(rule.verl + "."):
            return rule
    return None


def hybridrl_keys_for(verl_key: str) -> tuple[str, ...] | None:
    """Our keys for ``verl_key``; None when the table does not list it."""
    rule = rule_for(verl_key)
    return None if rule is None else rule.ours
