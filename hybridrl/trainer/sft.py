"""Supervised fine-tuning of the megatron actor on (prompt, response) pairs, any (t, p, d).

Contract:
- ``SFTTrainer(cfg, groups)`` (collective: every rank, same config) builds the tokenizer, the
  pairs (``cfg.sft.train_files``, else the synthetic task's ``sft_train.parquet``, written by
  every rank to the same path atomically), the actor on the training layout (``model.path`` or
  the builtin llama of ``model.*``, seed ``trainer.seed``: the same init as an RL run), its
  megatron optimizer (AdamW, ``sft.lr``, warmup, clip) and, when there are validation prompts,
  a ``RolloutWorker`` (the generation layout, so validation runs the reshard and the engine as
  RL does) and the reward scorer.
- ``fit()`` runs ``sft.total_steps`` optimizer steps; step s takes the next
  ``sft.train_batch_size`` pairs of a per-epoch permutation (seed ``data.seed + epoch``, the last
  partial batch dropped); DP rank r trains rows ``[r·B/dp, (r+1)·B/dp)`` of it in micro-batches
  of ``sft.micro_batch_size_per_gpu``. The loss is ``sum(-log p(response token)) / N`` with N
  the response tokens (EOS included) of the whole global batch, so the loss and gradients do
  not depend on (t, p, d). Returns the per-step metrics (``sft/loss``, ``sft/grad_norm``,
  ``sft/lr``, ``timing_s/step``, and at validation steps ``val/score/mean`` with the verl
  names), the same on every rank.
- ``validate()`` syncs the actor into the engine and returns ``(metrics, samples)`` of greedy
  (``rollout.val_temperature``) generation (``hybridrl.trainer.validation``).
- ``export(folder)`` writes the actor as an HF folder (``hybridrl.models.hf_io.export_hf``)
  that an RL run loads with ``model.path=<folder>``; an HF tokenizer is saved beside it.
- Rank 0 prints one line per step (loss, ETA) and appends it to ``<sft.output_dir>/metrics.jsonl``
  (``hybridrl.trainer.progress``).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from hybridrl.data.build import build_tokenizer, resolve_files
from hybridrl.data.dataset import PromptDataset
from hybridrl.data.loader import PromptLoader
from hybridrl.data.sft import SFTDataset, sft_microbatch
from hybridrl.models.hf_io import build_from_config, export_hf
from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step
from hybridrl.trainer.validation import validate_actor


def sft_files(cfg) -> list[str]:
    """The SFT parquet files: ``sft.train_files``, else the synthetic task's pairs."""
    if cfg.sft.train_files:
        return list(cfg.sft.train_files)
    syn = cfg.data.synthetic
    if cfg.data.train_files or syn.task != "arithmetic":
        raise ValueError("sft.train_files is empty and there is no synthetic task to draw pairs "
                         "from (data.train_files is set or data.synthetic.task is 'none'); set "
                         "sft.train_files")
    from hybridrl.data.arithmetic import write_sft_dataset

    n = cfg.sft.synthetic_size or syn.train_size
    return [write_sft_dataset(syn.dir, syn.train_size, min(n, syn.train_size), cfg.data.seed,
                              syn.max_digits, syn.second_digits,
                              cfg.sft.synthetic_format_fraction)]


def sft_loss(outputs: dict, batch: dict, *, n_tokens: float, scale: float):
    """This micro-batch's share of the global token-mean NLL (megatron divides by k, DDP
    averages over dp: ``scale`` = k·dp undoes both)."""
    logp_BT = outputs["logprobs"]
    mask_BT = batch["loss_mask"].to(logp_BT.device)
    nll = -(logp_BT * mask_BT).sum()
    return nll / n_tokens * scale, {}


class SFTTrainer:
    """The SFT loop (see the module docstring)."""

    def __init__(self, cfg, groups, *, print_fn=print):
        from hybridrl.trainer.progress import Progress
        from hybridrl.trainer.updates import ddp_options

        s = cfg.sft
        s.check_dp(groups.dp_size)
        self.progress = Progress(groups.rank, s.output_dir, print_fn, prefix="sft ")
        self.cfg, self.groups = cfg, groups
        self.tokenizer = build_tokenizer(cfg.model)
        self.data = SFTDataset(sft_files(cfg), self.tokenizer, s.max_length, s.prompt_key,
                               s.response_key)
        if len(self.data) < s.train_batch_size:
            raise ValueError(f"sft.train_batch_size ({s.train_batch_size}) exceeds the "
                             f"{len(self.data)} SFT pairs")
        self.actor = build_from_config(cfg.model, groups, "actor", seed=cfg.trainer.seed,
                                       ddp_options=ddp_options(cfg.actor))
        schedule = "warmup" if s.warmup_steps else "constant"
        self.opt = ModelOptimizer(self.actor, OptimConfig(
            lr=s.lr, lr_schedule=schedule, warmup_steps=s.warmup_steps,
            weight_decay=s.weight_decay, grad_clip=s.grad_clip))
        self.worker = self.val_loader = None
        val_files = resolve_files(cfg.data)[1] if not cfg.data.train_files else cfg.data.val_files
        if val_files:
            d = cfg.data
            self.val_loader = PromptLoader(PromptDataset(val_files, self.tokenizer,
                                                         d.max_prompt_length, d.truncation,
                                                         d.prompt_key),
                                           d.val_batch_size, shuffle=False, drop_last=False)
        if self.val_loader is not None:
            from hybridrl.rewards.distributed import DistributedScorer
            from hybridrl.rewards.scoring import build_reward_scorer
            from hybridrl.rollout.worker import RolloutWorker

            self.worker = RolloutWorker(cfg, groups, self.actor, self.tokenizer)
            self.scorer = DistributedScorer(build_reward_scorer(cfg.reward), self.tokenizer,
                                            cfg.reward, cfg.rollout.response_length)
        self.step = 0

    def batch_rows(self, step: int) -> list[int]:
        """Dataset rows of 0-based optimizer step ``step`` (global batch, every DP rank)."""
        b = self.cfg.sft.train_batch_size
        per_epoch = len(self.data) // b
        epoch, k = divmod(step, per_epoch)
        order = np.random.default_rng(self.cfg.data.seed + epoch).permutation(len(self.data))
        return [int(i) for i in order[k * b:(k + 1) * b]]

    def train_one(self, rows: list[int]) -> dict:
        """One optimizer step on the global batch ``rows``; metrics on every rank."""
        s, g = self.cfg.sft, self.groups
        examples = [self.data[i] for i in rows]
        n_tokens = float(sum(len(e.response_ids) for e in examples))
        per = len(rows) // g.dp_size
        mine = examples[g.dp_rank * per:(g.dp_rank + 1) * per]
        size = s.micro_batch_size_per_gpu
        pad = int(self.tokenizer.pad_token_id)
        mbs = [sft_microbatch(mine[i:i + size], pad) for i in range(0, len(mine), size)]
        scale = float(len(mbs) * g.dp_size)
        metrics = train_step(self.actor, self.opt, mbs,
                             lambda out, batch: sft_loss(out, batch, n_tokens=n_tokens, scale=scale),
                             with_entropy=False)
        self.opt.gather_params()
        return {"sft/loss": metrics["loss"], "sft/grad_norm": metrics["grad_norm"],
                "sft/lr": metrics["lr"]}

    def validate(self) -> tuple[dict, list[dict]]:
        if self.worker is None:
            return {}, []
        return validate_actor(self.worker, self.actor, self.scorer, self.val_loader, self.groups,
                              self.cfg.rollout, self.cfg.trainer.seed, self.tokenizer)

    def fit(self) -> list[dict]:
        s, history = self.cfg.sft, []
        self.progress.start(s.total_steps)
        while self.step < s.total_steps:
            t0 = time.perf_counter()
            metrics = self.train_one(self.batch_rows(self.step))
            self.step += 1
            metrics["timing_s/step"] = time.perf_counter() - t0
            if self.step == s.total_steps or (s.test_freq > 0 and self.step % s.test_freq == 0):
                val, samples = self.validate()
                metrics.update(val)
                self.progress.samples(self.step, samples)
            self.progress.step(self.step, metrics, keys=(("loss", "sft/loss"),
                                                        ("grad_norm", "sft/grad_norm"),
                                                        ("val", "val/score/mean")))
            history.append(metrics)
        return history

    def export(self, folder: str) -> str:
        export_hf(self.actor, folder)
        if self.groups.rank == 0 and hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(folder)
        torch.distributed.barrier()
        return os.fspath(folder)
