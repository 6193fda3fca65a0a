"""When the old-log-prob forward can be skipped: the actor update is exactly on-policy.

Contract:
- ``skip_old_forward(cfg) -> bool`` is True when nothing needs the actor's pre-update log-probs
  beyond the PPO ratio of a single optimizer step taken on the very weights that generated:
  ``actor.ppo_epochs == 1`` and one mini-batch per step (``actor.ppo_mini_batch_size`` >=
  ``data.train_batch_size``), no in-reward KL (``algorithm.use_kl_in_reward``, which reads them
  before the update) and no KL guard (``trainer.kl_guard.max_kl == 0``, which compares them with the
  post-update ones). Then old = the current log-probs, detached, inside the loss: the ratio is 1
  and the gradient is the one the separate forward would give (up to float rounding), as TRL and
  verl do for on-policy steps. Pure (reads the config only).
- ``old_or_current(old_BT, current_BT)``: ``current_BT.detach()`` when ``old_BT`` is None.
- The trainer's hook: ``self.on_policy = skip_old_forward(cfg)``; the old-log-prob phase then
  stores the engine's log-probs as ``old_log_probs`` placeholders for the batch bookkeeping only;
  ``_actor_loss`` passes ``old_or_current(None if self.on_policy else old, logp)``; the
  engine-vs-actor gap metrics (``GAP_METRICS``) are dropped, since they would read 0.
  tests/distributed/test_on_policy.py: the same metrics and weights as with the forward.
"""

from __future__ import annotations

import torch

GAP_METRICS = ("training/rollout_logprob_diff", "training/rollout_logprob_diff_max")


def skip_old_forward(cfg) -> bool:
    a = cfg.actor
    return (a.ppo_epochs == 1 and a.ppo_mini_batch_size >= cfg.data.train_batch_size
            and not cfg.algorithm.use_kl_in_reward and cfg.trainer.kl_guard.max_kl == 0)


def old_or_current(old_BT: torch.Tensor | None, current_BT: torch.Tensor) -> torch.Tensor:
    return current_BT.detach() if old_BT is None else old_BT
