"""What changes the work of a GRPO step, read from each side of the TRL comparison.

Contract: ``hybridrl_settings(cfg, world, entropy_in_update, threads)`` and
``trl_settings(trainer, world, entropy_in_update)`` return dicts with the SAME keys (dtype as
run, activation recompute, micro-batch and optimizer-step sizes, generation batch, samples per
prompt, sampling (temperature, top-k, top-p), optimizer (lr, schedule, weight decay, betas,
clipping), policy loss and its clip range, loss aggregation, advantage normalisation, KL
estimator and coefficient, whether the update's forward computes the entropy, torch threads,
processes), each value in one vocabulary (TRL's ``loss_type="dapo"`` is hybridrl's token-mean
over the optimizer step's tokens; its k3 is ``low_var_kl``). TRL's values are read from the
constructed trainer (its model's dtype, the accelerator's mixed precision, whether gradient
checkpointing is on), not only from its config. ``settings_mismatch(a, b)`` lists the keys that
differ; benchmarks/trl_compare.py refuses to report a cell unless it is empty.
"""

from __future__ import annotations


def hybridrl_settings(cfg, world: int, entropy_in_update: bool, threads: int) -> dict:
    """What changes the work of a hybridrl step, from the resolved config, in TRL's terms."""
    a, r = cfg.actor, cfg.rollout
    return {
        "dtype": cfg.model.dtype, "activation_recompute": cfg.model.recompute_granularity != "none",
        "micro_batch_seqs": a.ppo_micro_batch_size_per_gpu,
        "ref_micro_batch_seqs": cfg.ref.log_prob_micro_batch_size_per_gpu,
        "seqs_per_optimizer_step": a.ppo_mini_batch_size * r.n,
        "seqs_per_generation": cfg.data.train_batch_size * r.n, "samples_per_prompt": r.n,
        "updates_per_batch": a.ppo_epochs, "max_new_tokens": r.response_length,
        "temperature": r.temperature, "top_k": r.top_k if r.top_k > 0 else None, "top_p": r.top_p,
        "lr": a.lr, "lr_schedule": a.lr_schedule, "weight_decay": a.weight_decay,
        "adam_betas": list(a.adam_betas), "grad_clip": a.grad_clip,
        "clip_ratio": [a.clip_ratio_low, a.clip_ratio_high], "policy_loss": a.policy_loss,
        # token-mean over the optimizer step's tokens = TRL's "dapo" normalisation
        "loss_agg": {"token-mean": "tokens of the optimizer step"}.get(a.loss_agg_mode,
                                                                       a.loss_agg_mode),
        "advantage": "group mean / group std" if cfg.algorithm.adv_estimator == "grpo"
        and cfg.algorithm.norm_adv_by_std_in_grpo else cfg.algorithm.adv_estimator,
        "kl": [{"low_var_kl": "k3"}.get(a.kl_loss_type, a.kl_loss_type),
               a.kl_loss_coef if a.use_kl_loss else 0.0],
        "entropy_in_update": entropy_in_update, "threads_per_process": threads,
        "processes": world}


def trl_settings(trainer, world: int, entropy_in_update: bool) -> dict:
    """The same keys from a constructed GRPOTrainer: its args AND what it actually did."""
    import torch

    a = trainer.args
    dtype = next(trainer.model.parameters()).dtype
    mixed = str(trainer.accelerator.mixed_precision)
    return {
        "dtype": {"no": {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))}
        .get(mixed, f"autocast {mixed}"),
        "activation_recompute": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
        "micro_batch_seqs": a.per_device_train_batch_size,
        "ref_micro_batch_seqs": a.per_device_train_batch_size,
        "seqs_per_optimizer_step": a.per_device_train_batch_size * a.gradient_accumulation_steps
        * world, "seqs_per_generation": a.generation_batch_size,
        "samples_per_prompt": a.num_generations, "updates_per_batch": a.num_iterations,
        "max_new_tokens": a.max_completion_length, "temperature": a.temperature,
        "top_k": a.top_k if a.top_k and a.top_k > 0 else None, "top_p": a.top_p,
        "lr": a.learning_rate, "lr_schedule": str(getattr(a.lr_scheduler_type, "value",
                                                          a.lr_scheduler_type)),
        "weight_decay": a.weight_decay, "adam_betas": [a.adam_beta1, a.adam_beta2],
        "grad_clip": a.max_grad_norm,
        "clip_ratio": [a.epsilon, a.epsilon_high if a.epsilon_high is not None else a.epsilon],
        "policy_loss": "vanilla" if a.importance_sampling_level == "token" else
        a.importance_sampling_level,
        "loss_agg": {"dapo": "tokens of the optimizer step"}.get(a.loss_type, a.loss_type),
        "advantage": {"group": "group mean / group std"}.get(str(a.scale_rewards),
                                                             str(a.scale_rewards)),
        "kl": ["k3", a.beta], "entropy_in_update": entropy_in_update,
        "threads_per_process": torch.get_num_threads(), "processes": world}


def settings_mismatch(ours: dict, theirs: dict) -> list[str]:
    """The keys whose values differ (one line each); empty when the two sides do the same work."""
    return [f"{k}: hybridrl {ours.get(k)!r} vs TRL {theirs.get(k)!r}"
            for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
