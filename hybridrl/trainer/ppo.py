"""The PPO / GRPO loop: one step = reshard, rollout, score, log-probs, advantages, updates.

Contract:
- ``PPOTrainer(cfg, groups, *, train_data=None, val_data=None, reward_fn=None,
  adv_estimator=None)`` (collective: every rank, same config and arguments) builds the
  tokenizer, the loaders (parquet / synthetic, or rows given in memory; a reward callable or
  mapping, an estimator callable or name: ``hybridrl.trainer.inputs``), the megatron actor /
  reference (/ critic for GAE) on the training layout, their optimizers, the KL controller,
  the reward scorer and the ``RolloutWorker`` (engine on the generation layout + the reshard
  plan). ``fit()`` resumes when configured (only a checkpoint of the same run id:
  ``hybridrl.checkpoint.run_identity``), runs ``trainer.total_steps`` steps and returns the
  list of per-step metric dicts (every rank).
- One step (``train_step``), every rank:
  1. ``timing_s/reshard``: actor train shards -> engine shards (``RolloutWorker.sync_weights``;
     this rank's bytes and messages as ``reshard/*``; ``parallel.placement=split``: the engine
     lives on generation ranks of its own, ``hybridrl.rollout.split.remote``, and with
     ``rollout.async_steps=k`` the step's batch was generated while earlier steps trained:
     ``hybridrl.trainer.overlap``);
  2. ``timing_s/gen``: each gen replica samples its share of the prompts (``rollout.n`` per
     prompt); each DP replica then receives only the rows it trains on
     (``hybridrl.rollout.partition``: token-balanced per mini-batch chunk, prompt groups kept
     together when the estimator needs them, int32 ids + fp32 log-probs point to point); with
     ``algorithm.filter_groups`` generation and scoring repeat in rounds until the batch holds
     enough informative prompt groups (``hybridrl.trainer.dynamic_sampling``, DAPO);
  3. old log-probs (actor), reference log-probs (when a KL term is used), values (critic, GAE
     only): megatron forwards on this rank's rows only;
  4. reward (``hybridrl.rewards.distributed``: each sequence decoded and scored once in the job,
     only per-sequence scalars exchanged; or the frozen reward model's output at the last
     response token when ``reward.reward_model_path`` is set), placed on each sequence's last
     token; the in-reward KL (``algorithm.use_kl_in_reward``) updates the KL controller with
     the whole batch's KL; advantages (``hybridrl.algos.dist_advantages``) on the rank's rows with
     global whitening moments: the whole-batch numbers. A multi-turn batch
     (``rollout.multi_turn``, ``hybridrl.rollout.multi_turn``) is scored on its whole tail, but
     the reward's token, the KL, advantages, losses and guard see its ``loss_mask`` (the model's
     own tokens; masked steps carry GAE forward);
  5. ``actor.ppo_epochs`` (``critic.ppo_epochs``) passes over mini-batches of
     ``ppo_mini_batch_size * rollout.n`` sequences; each DP rank takes its share as fixed-size or
     token-budget micro-batches; the loss uses global normalizers (``hybridrl.trainer.updates``);
  6. step guard (``hybridrl.trainer.guards``): non-finite rewards/advantages skip the updates (the
     rows are named); non-finite losses, grad norms, KL or parameters on any rank, or a KL over
     ``trainer.kl_guard.max_kl``, restore actor, critic, optimizers and KL controller to their
     state before the step (``training/rolled_back`` = 1), or stop with ``RuntimeError``
     (``trainer.nonfinite=fail``, ``kl_guard.rollback: false``, too many in a row);
  7. metrics (DESIGN.md key names; reductions over every sequence of the step) on rank 0
     (``hybridrl.trainer.metrics_log``): one line per step to stdout, one JSON line to
     ``<run folder>/metrics.jsonl`` when ``jsonl`` is a logger (the run folder
     ``<trainer.output_dir>/<trainer.experiment_name>``: ``hybridrl.checkpoint.run_folder``); checkpoints
     every ``trainer.save_freq`` steps and after the last, sharded, resumable at another layout
     (``hybridrl.checkpoint.checkpointer``; also the KL guard's checkpoint-mode rollback).
- Each phase of a step runs with exactly its models' parts on the device and is timed
  (``PhaseMemory.timed``); validation is ``hybridrl.trainer.validation.validate_actor``, its samples
  go to ``<run folder>/generations.jsonl``.
- The trainer draws from random states of its own (``hybridrl.trainer.rng``: seeded by the
  model build, checkpointed): its public methods leave the caller's global states as they were.
- Log-probs are those of ``log_softmax(logits / T)`` with T = ``rollout.temperature`` (1 when
  greedy), as the engine reports them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.algos.dist_advantages import compute_advantage_dp, needs_groups
from hybridrl.algos.kl_control import apply_kl_in_reward, build_kl_controller
from hybridrl.checkpoint.checkpointer import Checkpointer
from hybridrl.checkpoint.folder import capture_state, restore_state
from hybridrl.checkpoint.run_identity import run_id
from hybridrl.config.root import HybridRLConfig
from hybridrl.data.batching import inverse_order
from hybridrl.data.build import build_tokenizer
from hybridrl.data.tokenizer import CharTokenizer, vocab_size
from hybridrl.models.forward import broadcast_from_last_stage, run_microbatches
from hybridrl.models.hf_io import build_from_config
from hybridrl.models.train_step import ModelOptimizer, OptimConfig
from hybridrl.parallel.groups import ParallelGroups
from hybridrl.planning.report import pipeline_lines
from hybridrl.rewards.distributed import DistributedScorer, global_score_metrics
from hybridrl.rewards.reward_model import place_on_last_token, value_at_last_token
from hybridrl.rollout.batch import RolloutBatch, batch_metrics, gather_response
from hybridrl.rollout.multi_turn import build_multi_turn
from hybridrl.rollout.multi_turn.turn_rewards import build_turn_rewards
from hybridrl.rollout.partition import TransportStats, plan_rollout_partition
from hybridrl.rollout.split.remote import build_rollout_worker
from hybridrl.rollout.worker import reshard_metrics
from hybridrl.trainer import dynamic_sampling
from hybridrl.trainer.guards import StepGuard
from hybridrl.trainer.inputs import build_data, reward_scorer, with_estimator
from hybridrl.trainer.metrics_log import build_metrics_log
from hybridrl.trainer.microbatches import (
    TokenTally,
    forward_parts,
    replay_tensors,
    share_prompts,
    sp_multiple,
)
from hybridrl.trainer.on_policy import GAP_METRICS, skip_old_forward
from hybridrl.trainer.overlap import Overlap
from hybridrl.trainer.phase_memory import PhaseMemory
from hybridrl.trainer.rng import RngScope, own_rng
from hybridrl.trainer.updates import actor_loss_fn, critic_loss_fn, ddp_options, ppo_updates
from hybridrl.trainer.validation import validate_actor


class PPOTrainer:
    """The PPO / GRPO loop (see module docstring); ``groups`` come from
    ``hybridrl.build_groups`` (``hybridrl.build_trainer`` makes both from a config)."""

    def __init__(self, cfg: HybridRLConfig, groups: ParallelGroups, *, train_data: Any = None,
                 val_data: Any = None, reward_fn: Callable | Mapping[str, Callable] | None = None,
                 adv_estimator: str | Callable | None = None,
                 print_fn: Callable[..., None] = print, split: Any = None) -> None:
        self._rng = RngScope()
        with self._rng:
            self._build(with_estimator(cfg, adv_estimator), groups, train_data, val_data,
                        reward_fn, print_fn, split)

    def _build(self, cfg, groups, train_data, val_data, reward_fn, print_fn, split) -> None:
        t_start = time.perf_counter()  # start-up phases are printed once the log exists
        self.cfg, self.groups = cfg, groups
        self.rank, self.world = groups.rank, dist.get_world_size()
        self.tokenizer = build_tokenizer(cfg.model)
        self.loader, self.val_loader = build_data(cfg, self.tokenizer, train_data, val_data,
                                                  reward_fn)
        seed = cfg.trainer.seed
        self.actor = build_from_config(cfg.model, groups, "actor", seed=seed,
                                       ddp_options=ddp_options(cfg.actor))
        n_ids, model_vocab = vocab_size(self.tokenizer), self.actor.spec.vocab_size
        if n_ids > model_vocab or (isinstance(self.tokenizer, CharTokenizer) and n_ids != model_vocab):
            raise ValueError(f"model.vocab_size={model_vocab} but the tokenizer has {n_ids} ids; "
                             f"the builtin character tokenizer needs model.vocab_size={n_ids} "
                             "(the policy must not sample ids the tokenizer cannot decode)")
        a = cfg.actor
        self.need_ref = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.ref = (build_from_config(cfg.model, groups, "reference", path=cfg.ref.model_path,
                                      seed=seed) if self.need_ref else None)
        self.critic = (build_from_config(cfg.model, groups, "critic", path=cfg.critic.model_path,
                                         seed=seed, ddp_options=ddp_options(cfg.critic))
                       if cfg.use_critic else None)
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * len(self.loader)
        self.actor_opt = self._optimizer(self.actor, a)
        self.on_policy = skip_old_forward(cfg)  # no old-log-prob forward (hybridrl/trainer/on_policy.py)
        self.critic_opt = self._optimizer(self.critic, cfg.critic) if self.critic else None
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = build_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.reward_model = None
        if cfg.reward.reward_model_path:  # critic architecture, frozen, on the train layout
            self.reward_model = build_from_config(cfg.model, groups, "reward",
                                                  path=cfg.reward.reward_model_path, seed=seed)
            if self.reward_model.spec.vocab_size != self.actor.spec.vocab_size:
                raise ValueError(
                    f"reward model vocab_size {self.reward_model.spec.vocab_size} != the actor's "
                    f"{self.actor.spec.vocab_size}: the reward model reads the actor's token "
                    "ids, so both must use the same tokenizer")
        t_models = time.perf_counter()
        self.scorer = reward_scorer(cfg, reward_fn)
        self.dist_scorer = DistributedScorer(self.scorer, self.tokenizer, cfg.reward,
                                             cfg.rollout.response_length)
        self.partition = None  # this step's (rows per DP rank, global sequence lengths)
        self.transport = TransportStats()  # this step's rollout hand-off bytes
        self.tally = TokenTally()  # tokens of the step's forwards (perf/pad_fraction)
        self.step, self.run_id, self.temperature = 0, run_id(cfg), cfg.rollout.temperature or 1.0
        self.log = build_metrics_log(cfg, self.rank, print_fn)  # the run folder's sinks
        for line in pipeline_lines(cfg, groups.dp_size):  # micro-batches, bubble, padding
            self.log.startup(f"hybridrl: {line}")
        ref_offload = {"params"} if cfg.ref.param_offload else set()
        self.memory = PhaseMemory({
            "actor": (self.actor, self.actor_opt, cfg.actor.offload_parts),
            "critic": (self.critic, self.critic_opt, cfg.critic.offload_parts),
            "reference": (self.ref, None, ref_offload),
            "reward": (self.reward_model, None, ref_offload)})
        self.worker = self.memory.start_engine(  # training state away first (docs/memory.md)
            lambda: build_rollout_worker(cfg, groups, self.actor, self.tokenizer, split))
        self.worker = build_multi_turn(cfg, self.tokenizer, self.worker)  # rollout.multi_turn
        self.turn_rewards = build_turn_rewards(cfg, self.tokenizer)  # its per-turn hook
        self.overlap = Overlap(self)  # rollout.async_steps (hybridrl/trainer/overlap.py)
        self.log.startup(f"hybridrl: models built and weights loaded ({t_models - t_start:.1f} s),"
                         f" engine ready ({time.perf_counter() - t_models:.1f} s)")
        self.guard = StepGuard(cfg.trainer, self.actor.device, self.log)
        self.phases = None  # a hybridrl.parallel.phases.PhaseBoard, when the entrypoint sets one
        self.ckpt = Checkpointer(self)

    def _optimizer(self, model, role_cfg) -> ModelOptimizer:
        per_step = role_cfg.ppo_epochs * (self.cfg.data.train_batch_size // role_cfg.ppo_mini_batch_size)
        return ModelOptimizer(model, OptimConfig.from_role_config(role_cfg, self.total_steps * per_step))

    # ------------------------------------------------------------------ rollout side
    def partition_shape(self) -> tuple[int, int]:
        """(chunk, group) of ``plan_rollout_partition``: every mini-batch spans all DP ranks;
        prompt groups stay together when the estimator needs them."""
        n = self.cfg.rollout.n
        chunk = self.cfg.actor.ppo_mini_batch_size * n
        if self.critic is not None:
            chunk = math.gcd(chunk, self.cfg.critic.ppo_mini_batch_size * n)
        return chunk, (n if needs_groups(self.cfg.algorithm.adv_estimator) else 1)

    def _rollout(self, prompts) -> RolloutBatch:
        """This DP rank's rows of the step's N = prompts x ``rollout.n`` sequences."""
        n, r = self.cfg.rollout.n, self.cfg.rollout
        uid = [i for i in range(len(prompts)) for _ in range(n)]  # each prompt n times
        prompt_lens = [len(prompts.prompt_ids[i]) for i in uid]
        chunk, group = self.partition_shape()

        def plan(resp_lens):
            lens = [p + q for p, q in zip(prompt_lens, resp_lens)]
            self.partition = (plan_rollout_partition(lens, self.groups.dp_size, chunk, group),
                              lens)
            return self.partition[0]

        params = self.worker.sampling_params(r.response_length, r.temperature, r.top_k, r.top_p)
        rows, out, transport = self.worker.generate_partitioned(
            [prompts.prompt_ids[i] for i in uid], params,
            seed=self.cfg.trainer.seed * 100_003 + self.step, plan_parts=plan)
        self.transport += transport  # the step's hand-offs (DAPO: every round's)
        pick = [uid[g] for g in rows]
        return RolloutBatch([prompts.prompt_ids[i] for i in pick], out.response_ids,
                            out.response_mask, out.logprobs, pick,
                            [prompts.ground_truth[i] for i in pick],
                            [prompts.data_source[i] for i in pick],
                            [prompts.extra_info[i] for i in pick], rows=rows,
                            loss_mask=getattr(out, "loss_mask", None),  # multi-turn: model tokens
                            routed_experts=out.routed_experts)  # MoE: actor.router_replay

    def _gloo_dp(self):
        """The DP group for CPU scalars (None at dp = 1)."""
        return self.groups.gloo_dp if self.groups.dp_size > 1 else None

    @torch.no_grad()
    def _forward(self, model, rb: RolloutBatch, key: str, micro: int, dynamic: bool,
                 max_tokens: int, shift: int = 0) -> torch.Tensor:
        """Per-token ``key`` output [n, R] of ``model`` on this rank's rows.

        Column j is the output at the position that predicts response token j (``shift=0``), or
        at response token j itself (``shift=1``: a reward model reads the whole sequence)."""
        mine, packed = list(range(len(rb))), self.cfg.model.pack_sequences
        replay = replay_tensors(self.cfg.actor, rb) if model is self.actor else None
        share = share_prompts(self.cfg.model, model, replay)
        parts = forward_parts(rb.seq_lengths, micro, dynamic, max_tokens, packed,
                              min_count=self.groups.pp_size, groups=rb.uid if share else None)
        mbs = [rb.microbatch(p, replay, packed=packed, share=share) for p in parts]
        with self.tally.count(mbs, sp_multiple(model)):
            outs = run_microbatches(model, mbs, with_entropy=False, temperature=self.temperature)
        local = None
        if self.groups.is_last_stage:
            cols = [gather_response(o[key], (mb["resp_index"] + shift).clamp(
                max=o[key].shape[1] - 1)).float().cpu() for o, mb in zip(outs, mbs)]
            position = {row: j for j, row in enumerate(mine)}
            order = inverse_order([[position[i] for i in p] for p in parts])
            local = torch.cat(cols)[order]  # [n, R] in row order
        return broadcast_from_last_stage(local, self.groups).to(self.actor.device).cpu()

    def _reward_model_scores(self, rb: RolloutBatch, mask: torch.Tensor):
        """(scores [n], global metrics): the reward model's value at each row's last response token
        (0 for an empty response), with the ``ref`` section's forward batching."""
        r = self.cfg.ref
        values = self._forward(self.reward_model, rb, "values",
                               r.log_prob_micro_batch_size_per_gpu, r.log_prob_use_dynamic_bsz,
                               r.log_prob_max_token_len_per_gpu, shift=1)
        scores = value_at_last_token(values, mask)
        return scores, global_score_metrics(scores, self._gloo_dp())

    def _logprobs(self, model, rb: RolloutBatch) -> torch.Tensor:
        """Per-token log-probs [n, R] of ``model`` with the ``ref`` section's batching."""
        r = self.cfg.ref
        return self._forward(model, rb, "logprobs", r.log_prob_micro_batch_size_per_gpu,
                             r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu)

    # ------------------------------------------------------------------ updates
    def _actor_loss(self, outputs, batch, *, norm, k):
        return actor_loss_fn(self.cfg.actor, self.on_policy, outputs, batch, norm=norm, k=k)

    def _critic_loss(self, outputs, batch, *, norm, k):
        return critic_loss_fn(self.cfg.critic, outputs, batch, norm=norm, k=k)

    def _update(self, model, opt, role_cfg, rb, tensors, loss_method, prefix) -> dict:
        return ppo_updates(model, opt, role_cfg, rb, tensors, loss_method, prefix,
                           partition=self.partition, groups=self.groups, n=self.cfg.rollout.n,
                           loss_scale=self.cfg.rollout.response_length,
                           temperature=self.temperature, packed=self.cfg.model.pack_sequences,
                           tally=self.tally, share=share_prompts(self.cfg.model, model))

    # ------------------------------------------------------------------ one step
    @own_rng
    def train_step(self) -> dict:
        """One PPO step (module docstring) on every rank; the step's metrics."""
        cfg, t0 = self.cfg, time.perf_counter()
        timing = self.phases.step_timing(self.step + 1) if self.phases else {}
        snapshot = self._snapshot() if self.guard.needs_snapshot else None
        prompts = self.overlap.prompts(timing)  # async_steps 1: generated while k-1 trained
        with self.memory.timed(timing, "reshard"):
            sync = self.worker.sync_weights(self.actor)
        scored = None  # DAPO dynamic sampling scores while it generates (algorithm.filter_groups)
        self.transport = TransportStats()  # rollout/handoff_bytes
        with self.memory.timed(timing, "gen"):
            if cfg.algorithm.filter_groups.enable:
                rb, *scored = dynamic_sampling.collect(self, prompts)
            else:
                rb = self._rollout(prompts)
            self.overlap.prefetch()  # async_steps 1: the next batch, on the weights just synced
            self.worker.release()  # SGLang gives its GPU memory back before training
        whole = rb.response_mask  # every response token: what rewards read
        mask = whole if rb.loss_mask is None else rb.loss_mask  # what advantages and KL see
        a = cfg.actor
        with self.memory.timed(timing, "old_log_prob"):
            old = rb.rollout_logprobs if self.on_policy else self._logprobs(self.actor, rb)
        tensors = {"old_log_probs": old}
        if a.rollout_is:  # the engine's log-probs for the rollout IS weights (actor.rollout_is)
            tensors["rollout_log_probs"] = rb.rollout_logprobs
        if self.ref is not None:
            with self.memory.timed(timing, "ref"):
                tensors["ref_log_probs"] = self._logprobs(self.ref, rb)
        if self.critic is not None:
            c = cfg.critic
            with self.memory.timed(timing, "values"):
                tensors["values"] = self._forward(self.critic, rb, "values",
                                                  c.ppo_micro_batch_size_per_gpu,
                                                  c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu)
        metrics = {}
        with self.memory.timed(timing, "reward"):
            if scored:
                scores, reward_metrics = scored[0], {**scored[1], **scored[2]}
            elif self.reward_model is not None:
                scores, reward_metrics = self._reward_model_scores(rb, whole)
            else:
                g = self.groups  # the replica's TP x PP ranks share its rows' scoring
                scores, reward_metrics = self.dist_scorer.score(
                    rb.rows, rb.response_ids, whole, rb.ground_truth, rb.data_source,
                    rb.extra_info, g.tp_rank + g.tp_size * g.pp_rank, g.tp_size * g.pp_size)
        metrics.update(reward_metrics)
        with self.memory.timed(timing, "adv"):
            rewards = place_on_last_token(scores, mask).float()
            if self.turn_rewards is not None:  # multi-turn: each turn's reward at its end
                turn = self.turn_rewards(rb)
                rewards = rewards + turn  # (its metric: this rank's rows, per sequence)
                metrics["multi_turn/turn_reward/mean"] = float(turn.sum()) / max(len(rb), 1)
            if cfg.algorithm.use_kl_in_reward:
                rewards, kl_metrics = apply_kl_in_reward(rewards, old, tensors["ref_log_probs"],
                                                         mask, self.kl_ctrl,
                                                         cfg.algorithm.kl_penalty,
                                                         dp_group=self._gloo_dp())
                metrics.update(kl_metrics)
            alg = cfg.algorithm
            tensors["advantages"], tensors["returns"] = compute_advantage_dp(
                alg.adv_estimator, rewards, mask.float(), rows=rb.rows, dp_group=self._gloo_dp(),
                device="cpu", values=tensors.get("values"), index=rb.uid, gamma=alg.gamma, lam=alg.lam,
                norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo)
        skip = self.guard.check_inputs(self.step + 1, scores, tensors, rb)  # every rank agrees
        if self.critic is not None and not skip:
            with self.memory.timed(timing, "update_critic"):
                metrics.update(self._update(self.critic, self.critic_opt, cfg.critic, rb, tensors,
                                            self._critic_loss, "critic"))
        with self.memory.timed(timing, "update_actor"):
            metrics.update({} if skip else self._update(self.actor, self.actor_opt, a, rb,
                                                        tensors, self._actor_loss, "actor"))
        if cfg.trainer.kl_guard.max_kl > 0 and not skip:  # the weights it would keep: a forward
            with self.memory.timed(timing, "kl_guard"):  # over kl_guard.row_fraction of the rows
                metrics.update(self.guard.final_kl(
                    rb, old, mask, lambda sub: self._logprobs(self.actor, sub), self._gloo_dp()))
        metrics.update(self.guard.judge(self.step + 1, metrics, skip, snapshot, self._restore,
                                        self._models()))
        timing["timing_s/step"] = time.perf_counter() - t0
        batch = batch_metrics(rb, tensors, self.cfg.rollout.response_length, timing["timing_s/step"],
                              self.world, self._gloo_dp())
        batch = {k: v for k, v in batch.items() if not (self.on_policy and k in GAP_METRICS)}
        batch.update(self.tally.pop_metrics(self._gloo_dp()))  # perf/pad_fraction, tokens_per_s
        return {**metrics, **batch, **timing, **reshard_metrics(sync), **self.overlap.metrics(),
                **self.transport.metrics(), **getattr(self.worker, "pop_metrics", dict)()}

    # ------------------------------------------------------------------ KL guard
    def _models(self):
        pairs = [(self.actor, self.actor_opt), (self.critic, self.critic_opt)]
        return [(m, o) for m, o in pairs if m is not None]

    def _snapshot(self) -> dict:
        self.memory.enter("snapshot")  # the optimizer state is read where it lives: the device
        return capture_state(self._models(), self.kl_ctrl)

    def _restore(self, snap: dict) -> None:
        self.memory.enter("snapshot")  # the optimizer state (and the weights it rebuilds)
        restore_state(self._models(), snap, self.kl_ctrl)

    # ------------------------------------------------------------------ validation
    @own_rng
    def validate(self) -> dict:
        """Greedy (``rollout.val_temperature``) responses on the validation prompts."""
        if self.val_loader is None:
            return {}
        metrics, samples = validate_actor(self.worker, self.actor, self.dist_scorer,
                                          self.val_loader, self.groups, self.cfg.rollout,
                                          self.cfg.trainer.seed, self.tokenizer,
                                          enter=self.memory.enter)  # each DP replica: its rows
        self.log.samples(self.step, samples)  # a few printed, all in generations.jsonl
        pop = getattr(self.worker, "pop_metrics", None)  # multi-turn: val/multi_turn/*
        return {**metrics, **(pop("val/multi_turn/") if pop else {})}

    # ------------------------------------------------------------------ checkpoints
    @own_rng
    def save(self) -> Path:
        """Checkpoint ``global_step_<step>`` (``hybridrl.checkpoint.checkpointer``)."""
        return self.ckpt.save()

    # ------------------------------------------------------------------ driver
    @own_rng
    def fit(self) -> list[dict]:
        """Resume if configured, then train to ``total_steps``; per-step metrics."""
        t = self.cfg.trainer
        resumed = self.ckpt.start()
        self.log.resume_at(self.step)
        g = self.groups.train
        self.log.line(f"hybridrl: world {self.world}, train tp {g.tp} pp {g.pp} dp {g.dp}, "
                      f"gen tp {self.worker.gen.tp} x {self.worker.n_replicas} replicas, "
                      f"reshard {self.worker.strategy}, steps {self.step + 1}..{self.total_steps}"
                      f", run folder {t.run_dir}"
                      + (f" (resumed from {resumed})" if resumed else ""))
        if self.step >= self.total_steps:
            self.log.line(f"nothing to do: the checkpoint is at step {self.step} >= "
                          f"trainer.total_steps={self.total_steps} (raise total_steps, or set "
                          "trainer.resume=disable to start over)")
        if t.val_before_train and self.step == 0:
            self.log.line(f"step 0 | val {self.validate().get('val/score/mean', float('nan')):.4g}")
        history = []
        while self.step < self.total_steps:
            metrics = self.train_step()
            self.step += 1
            if t.test_freq > 0 and (self.step % t.test_freq == 0 or self.step == self.total_steps):
                metrics.update(self.validate())
            metrics.update(self.ckpt.step_metrics())
            self.log.step(self.step, self.total_steps, metrics)  # logged before it is saved
            history.append(metrics)
            self.ckpt.after_step()  # saves, or a KL-guard checkpoint rollback
        self.ckpt.wait()
        self.log.close()
        return history

