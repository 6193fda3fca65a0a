"""The run machinery: the PPO and SFT loops and everything they need to run.

Contract: the loops are thin; each capability is a module of its own that the loop calls.

- ``ppo``: ``PPOTrainer``, one PPO/GRPO step = reshard, rollout, reward, forwards, advantages,
  updates, guard, metrics, checkpoint (docs/trainer.md).
- ``updates``: the PPO updates of a step (epochs, mini-batches, micro-batches per DP rank, the
  actor and critic losses).
- ``dynamic_sampling``: DAPO's generation rounds until enough prompt groups are informative.
- ``entry``: ``build_trainer`` / ``build_layout``, the trainer built from Python objects (the
  layouts, groups and start-up checks ``python -m hybridrl.train`` runs).
- ``inputs``: prompts, reward functions and estimators given as Python objects.
- ``rng``: the trainer's own RNG states (the caller's global RNG left as found).
- ``sft``: ``SFTTrainer``, the supervised warm start (``hybridrl.sft``'s loop).
- ``startup``: the checks every rank runs before any collective (one line per problem).
- ``guards``: the step guard (non-finite values, the KL guard's rollback).
- ``phase_memory``: what lives on the device in each phase (offload between phases).
- ``on_policy``: when the old-log-prob forward can be skipped.
- ``validation``: held-out scores and sample generations.
- ``progress``, ``metrics_log``, ``tracking``: the progress line, metrics.jsonl and the
  optional sinks (wandb, mlflow, tensorboard).

Layering: imports the algorithms (``hybridrl.algos``), checkpoints (``hybridrl.checkpoint``)
and every floor below them; nothing below imports this folder (``tests/unit/test_layering.py``).
"""
