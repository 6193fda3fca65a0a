"""The PPO updates of one step: epochs over mini-batches, micro-batches per DP rank, the losses.

Contract:
- ``ppo_updates(model, opt, role_cfg, rb, tensors, loss_method, prefix, *, partition, groups, n,
  loss_scale, temperature, packed, tally)`` runs ``role_cfg.ppo_epochs`` passes over
  mini-batches of ``role_cfg.ppo_mini_batch_size * n`` consecutive global rows; this DP rank
  takes its rows of each (``partition`` = (rows per DP rank, global sequence lengths), the
  step's ``plan_rollout_partition``) as fixed-size micro-batches of
  ``ppo_micro_batch_size_per_gpu`` sequences or, with ``use_dynamic_bsz``, token-budget
  micro-batches of the same count on every DP rank (``packed``: each micro-batch one pack of
  whole sequences, budgets in real tokens, ``hybridrl.models.packing``; ``tally``, a
  ``TokenTally``, counts their tokens; ``share``: rows of a micro-batch with one prompt
  compute it once, ``RolloutBatch.microbatch(share=True)``, not with routing replay; the
  token-budget plan then keeps each prompt group's ``n`` consecutive rows in one pack where
  the budget allows). The
  loss uses the global normalizers of the mini-batch
  (``compute_agg_normalizers`` over ``groups.dp``, verl's constant ``loss_scale``) over the
  tokens the losses see: ``rb.loss_mask`` when the batch has one (a multi-turn rollout's own
  model tokens; it then rides in each micro-batch as ``loss_mask``), else ``response_mask``.
  With ``role_cfg.router_replay == "rollout"``, ``rb.routed_experts`` (a MoE rollout's; a batch
  without them is a ValueError) ride in each micro-batch as ``routed_experts`` (the forward
  replays them: ``hybridrl.models.router_replay``) and the metrics add
  ``actor/router_agreement``.
  One optimizer step per mini-batch
  (``hybridrl.models.train_step``); the weights are gathered whole afterwards (the next reader
  needs them). Returns the metrics averaged over the optimizer steps, ``<prefix>/<name>`` (keys
  with a ``/`` kept as they are), plus ``actor/ppo_kl_max`` when the actor's KL is reported.
- ``actor_loss_fn(actor_cfg, on_policy, outputs, batch, *, norm, k)`` and
  ``critic_loss_fn(critic_cfg, outputs, batch, *, norm, k)``: the per-micro-batch losses
  (``hybridrl.algos.losses``) on the tokens the losses see (``loss_mask_of``: the
  micro-batch's ``loss_mask`` when it has one, as verl's multi-turn critic and actor);
  ``on_policy`` uses the current log-probs,
  detached, as the old ones (``hybridrl.trainer.on_policy``). megatron divides each
  micro-batch loss by the ``k`` micro-batches; the global normalizers already count all of them,
  so the loss and its share metrics are scaled back by ``k``.
- ``ddp_options(role_cfg)``: how megatron's DDP and optimizer hold a trained role.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import numpy as np

from hybridrl.algos.agg import compute_agg_normalizers
from hybridrl.algos.losses import actor_loss, value_loss
from hybridrl.data.batching import plan_dp_micro_batches, split_mini_batches
from hybridrl.models.build import DDPOptions
from hybridrl.models.router_replay import agreement_metric
from hybridrl.models.train_step import train_step
from hybridrl.rollout.batch import gather_response
from hybridrl.trainer.microbatches import TokenTally, replay_tensors, sp_multiple
from hybridrl.trainer.on_policy import old_or_current

SHARE_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "critic/vf_loss")


def ddp_options(role_cfg) -> DDPOptions:
    """How megatron's DDP and optimizer hold a trained role (its config section)."""
    return DDPOptions(use_distributed_optimizer=role_cfg.use_distributed_optimizer,
                      overlap_grad_reduce=role_cfg.overlap_grad_reduce,
                      overlap_param_gather=(role_cfg.overlap_param_gather
                                            and role_cfg.use_distributed_optimizer))


def actor_loss_fn(a, on_policy: bool, outputs, batch, *, norm, k):
    """The actor's loss of one micro-batch (``a``: the actor config section)."""
    dev = outputs["logprobs"].device
    idx = batch["resp_index"]
    ent = gather_response(outputs["entropy"], idx) if "entropy" in outputs else None
    logp = gather_response(outputs["logprobs"], idx)
    loss, metrics = actor_loss(
        old_or_current(None if on_policy else batch["old_log_probs"].to(dev), logp), logp,
        batch["advantages"].to(dev), loss_mask_of(batch).to(dev),
        policy_loss=a.policy_loss, entropy_BT=ent, entropy_coeff=a.entropy_coeff,
        ref_log_prob=batch["ref_log_probs"].to(dev) if "ref_log_probs" in batch else None,
        use_kl_loss=a.use_kl_loss, kl_loss_type=a.kl_loss_type, kl_loss_coef=a.kl_loss_coef,
        loss_agg_mode=a.loss_agg_mode, norm=norm, clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
        rollout_log_prob=batch["rollout_log_probs"].to(dev) if a.rollout_is else None,
        rollout_is=a.rollout_is, rollout_is_cap=a.rollout_is_cap)
    return _undo_megatron_mean(loss, metrics, k)


def loss_mask_of(batch):
    """The response tokens the losses see: ``loss_mask`` when present, else ``response_mask``."""
    return batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]


def critic_loss_fn(c, outputs, batch, *, norm, k):
    """The critic's value loss of one micro-batch (``c``: the critic config section)."""
    dev = outputs["values"].device
    vpreds = gather_response(outputs["values"], batch["resp_index"])
    loss, metrics = value_loss(vpreds, batch["returns"].to(dev), batch["values"].to(dev),
                               loss_mask_of(batch).to(dev), c.cliprange_value,
                               c.loss_agg_mode, norm)
    return _undo_megatron_mean(loss, metrics, k)


def ppo_updates(model, opt, role_cfg, rb, tensors, loss_method, prefix: str, *, partition, groups,
                n: int, loss_scale: int, temperature: float, packed: bool = False,
                tally: TokenTally | None = None, share: bool = False) -> dict:
    """PPO epochs over mini-batches of one model (see module doc)."""
    dp = groups.dp_size
    mini = role_cfg.ppo_mini_batch_size * n
    acc = defaultdict(list)
    parts, lens = partition
    local = {g: j for j, g in enumerate(rb.rows)}
    if rb.loss_mask is not None:  # a multi-turn batch: the model's own tokens
        tensors = {**tensors, "loss_mask": rb.loss_mask}
    replay = replay_tensors(role_cfg, rb)  # MoE: the forwards route as the rollout engine did
    tensors = {**tensors, **replay}
    for _ in range(role_cfg.ppo_epochs):
        for rows in split_mini_batches(len(lens), mini):  # consecutive global rows
            lo, hi = rows[0], rows[-1] + 1
            if role_cfg.use_dynamic_bsz:  # the same micro-batch count on every DP rank
                plans = plan_dp_micro_batches(
                    lens[lo:hi], dp, role_cfg.ppo_max_token_len_per_gpu,
                    partition=[[g - lo for g in p if lo <= g < hi] for p in parts],
                    packed=packed, min_count=groups.pp_size,  # >= pp: the pipeline fills
                    groups=[(lo + j) // n for j in range(hi - lo)] if share else None)
                micro = [[local[lo + j] for j in mb] for mb in plans[groups.dp_rank].micro_batches]
            else:
                mine = [j for g, j in local.items() if lo <= g < hi]
                size = role_cfg.ppo_micro_batch_size_per_gpu
                micro = [mine[s:s + size] for s in range(0, len(mine), size)]
            mbs = [rb.microbatch(m, tensors, packed=packed, share=share and not replay)
                   for m in micro]
            norm = compute_agg_normalizers(  # on the model's device: NCCL takes no CPU tensors
                [loss_mask_of(mb).to(model.device) for mb in mbs],
                groups.dp if dp > 1 else None, loss_scale_factor=loss_scale)  # verl: a constant L
            loss_fn = functools.partial(loss_method, norm=norm, k=len(mbs))
            with (tally or TokenTally()).count(mbs, sp_multiple(model)):
                step = train_step(model, opt, mbs, loss_fn, temperature=temperature)
            for key, value in step.items():
                acc[key].append(value)
    opt.gather_params()  # the next reader (reshard, guard, save) needs whole weights
    out = {(k if "/" in k else f"{prefix}/{k}"): float(np.mean(v)) for k, v in acc.items()}
    if "actor/ppo_kl" in acc:
        out["actor/ppo_kl_max"] = float(max(abs(v) for v in acc["actor/ppo_kl"]))
    if replay:
        out.update(agreement_metric(model.module, groups.dp if dp > 1 else None, model.device))
    return out


def _undo_megatron_mean(loss, metrics: dict, k: int):
    """megatron divides each micro-batch loss by k; the global normalizers already count every
    micro-batch, so scale the loss (and the aggregated metrics) back by k."""
    metrics = {key: v * k if key in SHARE_METRICS else v for key, v in metrics.items()}
    return loss * k, metrics
