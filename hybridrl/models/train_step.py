"""One optimizer step of a sharded model: micro-batches, DP sync, global-norm clip, AdamW + LR.

Contract:
- ``OptimConfig`` holds the knobs (``from_role_config`` reads hybridrl's actor/critic section);
  ``lr_at(cfg, step)`` is the pure LR schedule for the 0-based optimizer step ``step``:
  constant: ``lr``; warmup: ``lr * min(1, (step + 1) / warmup_steps)``; cosine: the same warmup,
  then ``lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)`` with ``r = min_lr_ratio`` and
  ``p = clamp((step + 1 - warmup) / (total_steps - warmup), 0, 1)``.
- ``ModelOptimizer(model, cfg)``: megatron-core's optimizer (``get_megatron_optimizer``; Adam
  with decoupled weight decay, none on 1-D parameters and biases) over the model's megatron DDP.
  With ``model.ddp_options.use_distributed_optimizer`` (the default) it is megatron's
  DistributedOptimizer: gradients are reduce-scattered over ``groups.dp``, each DP rank keeps
  only its 1/dp shard of the fp32 main parameters (masters of bf16/fp16 models) and Adam moments,
  updates that shard and all-gathers the parameters (deferred into the next forward with
  ``overlap_param_gather``: ``gather_params()`` completes it). Otherwise every DP rank holds all
  of it (gradients all-reduced). On CPU it runs through ``cpu_compat`` (gloo collectives).
  ``step()`` finalizes, clips, applies:
  1. megatron's ``finalize_model_grads``: the DP reduction of DDP's fp32 ``main_grad`` buckets
     and, for tied embeddings with pp > 1, the sum of the word-embedding and output-layer
     gradients over the first/last-stage ``embd`` group;
  2. megatron's global norm (each parameter counted once across TP, PP and DP shards); a
     non-finite norm skips the update on every rank (``skipped`` = 1: NaN/inf never reach the
     weights or the optimizer state); if ``grad_clip`` > 0 and the norm exceeds it, gradients
     are scaled by ``grad_clip / (norm + 1e-6)``;
  3. Adam with the learning rate ``lr_at(cfg, step_count) * lr_scale`` (``lr_scale`` = 1
     unless the KL guard's checkpoint mode lowered it).
  ``state_dict()`` / ``load_state_dict()`` copy and restore this rank's optimizer state (its DP
  shard); restoring also rebuilds the model's parameters from the fp32 main parameters, so the
  pair is a complete snapshot of a trained model at a fixed layout (``rebuild_params()`` is
  that second half: parameters from the main parameters). ``state_bytes()`` counts the
  optimizer-owned bytes on this rank (moments + separate masters).
- ``train_step(model, optimizer, microbatches, loss_fn)`` runs ``forward.run_microbatches`` with
  the loss callback, then ``optimizer.step()``; it returns the metrics of the step on every rank:
  the mean over micro-batches and DP ranks of each scalar the callback reported (``loss``
  included), ``grad_norm`` (before clipping) and ``lr``. The objective is the mean of the
  callback's per-micro-batch losses over all micro-batches of all DP ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.distributed as dist

from hybridrl.models import cpu_compat
from hybridrl.models.build import ShardedModel, ensure_megatron_state
from hybridrl.models.forward import broadcast_from_last_stage, run_microbatches

LR_SCHEDULES = ("constant", "warmup", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW, LR schedule and clipping of one trained model."""

    lr: float = 1e-6
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0  # cosine: steps until min_lr_ratio * lr
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = no clipping

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.lr_schedule == "warmup" and self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 for 'warmup', got {self.warmup_steps}")
        if self.lr_schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"cosine needs total_steps > warmup_steps, got total_steps="
                             f"{self.total_steps}, warmup_steps={self.warmup_steps}")
        if self.lr <= 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError(f"need lr > 0, grad_clip >= 0, weight_decay >= 0; got lr={self.lr}, "
                             f"grad_clip={self.grad_clip}, weight_decay={self.weight_decay}")

    @classmethod
    def from_role_config(cls, role, total_steps: int = 0) -> OptimConfig:
        """From hybridrl's ActorConfig/CriticConfig (``total_steps``: the run's optimizer steps)."""
        return cls(lr=role.lr, lr_schedule=role.lr_schedule, warmup_steps=role.warmup_steps,
                   total_steps=total_steps, min_lr_ratio=role.min_lr_ratio,
                   weight_decay=role.weight_decay, betas=tuple(role.adam_betas),
                   grad_clip=role.grad_clip)


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Learning rate of the 0-based optimizer step ``step``."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    done = step + 1
    if cfg.warmup_steps and done < cfg.warmup_steps:
        return cfg.lr * done / cfg.warmup_steps
    if cfg.lr_schedule == "warmup":
        return cfg.lr
    progress = min(max((done - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps), 0.0), 1.0)
    r = cfg.min_lr_ratio
    return cfg.lr * (r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * progress)))


class ModelOptimizer:
    """megatron-core's optimizer over one ShardedModel (see the module docstring)."""

    def __init__(self, model: ShardedModel, cfg: OptimConfig):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if model.ddp is None:
            raise ValueError(f"the {model.role} model is frozen; it has no optimizer")
        self.model, self.cfg, self.step_count = model, cfg, 0
        self.lr_scale = 1.0  # the KL guard's checkpoint mode lowers it (times lr_factor)
        self.distributed = model.ddp_options.use_distributed_optimizer
        mcfg = OptimizerConfig(
            optimizer="adam", lr=lr_at(cfg, 0), weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.eps,
            clip_grad=cfg.grad_clip,  # step() clips (and computes the norm) itself
            bf16=model.dtype == "bf16", fp16=model.dtype == "fp16",
            params_dtype=model.config.params_dtype,
            use_distributed_optimizer=self.distributed,
            overlap_param_gather=model.ddp_options.overlap_param_gather)
        ensure_megatron_state(model.groups)
        with cpu_compat.cuda_type_names():
            self.optimizer = get_megatron_optimizer(
                mcfg, [model.ddp], pg_collection=model.pg_collection,
                use_gloo_process_groups=False)
        if model.dtype == "fp16":  # megatron's dynamic loss scale, applied by the schedules
            model.config.grad_scale_func = self.optimizer.scale_loss

    @property
    def _parts(self) -> list:
        """megatron's per-group optimizers (get_megatron_optimizer returns a ChainedOptimizer)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def main_params(self) -> list[torch.Tensor]:
        """This rank's fp32 main parameters: its DP shard (distributed) or all of its stage."""
        return [p for part in self._parts for group in part.optimizer.param_groups
                for p in group["params"]]

    def state_bytes(self) -> int:
        """Bytes of optimizer-owned tensors on this rank: the Adam moments, plus the fp32 master
        copies when the model's parameters are 16-bit (fp32 models are stepped in place)."""
        moments = sum(t.numel() * t.element_size() for part in self._parts
                      for st in part.optimizer.state.values()
                      for key, t in st.items() if key != "step" and torch.is_tensor(t))
        masters = (0 if self.model.config.params_dtype == torch.float32 else
                   sum(p.numel() * p.element_size() for p in self.main_params()))
        return moments + masters

    def state_dict(self) -> dict:
        """This rank's optimizer state (its DP shard with the distributed optimizer): Adam state,
        fp32 main parameters and the step count. With the same layout it restores the model's
        parameters too (``load_state_dict``)."""
        return {"optimizer": [copy.deepcopy(part.optimizer.state_dict())  # not views of live
                              for part in self._parts],  # state
                "main_params": [p.detach().clone() for p in self.main_params()],
                "step_count": self.step_count,
                "grad_scaler": [_scaler(part) and _scaler(part).state_dict()
                                for part in self._parts]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output of the same rank and layout, then rebuild the model's
        parameters from the main parameters (copy, and the DP all-gather when sharded)."""
        mains = self.main_params()
        saved = state["main_params"]
        if len(saved) != len(mains) or any(a.shape != b.shape for a, b in zip(saved, mains)):
            raise ValueError(f"optimizer state holds {len(saved)} main-parameter shards, this "
                             f"rank has {len(mains)} (or their shapes differ): it was saved by "
                             "another layout or model")
        for part, inner, scaler in zip(self._parts, state["optimizer"], state["grad_scaler"]):
            part.optimizer.load_state_dict(inner)
            if scaler:
                _scaler(part).load_state_dict(scaler)
        for main, value in zip(mains, saved):
            main.copy_(value)
        self.step_count = int(state["step_count"])
        self.rebuild_params()

    @torch.no_grad()
    def rebuild_params(self) -> None:
        """The model's parameters from the fp32 main parameters (collective over DP when the
        optimizer is distributed: the other ranks' shards arrive by all-gather)."""
        for part in self._parts:  # fp32 models: the main params are the model's own
            if hasattr(part, "_copy_main_params_to_model_params"):
                part._copy_main_params_to_model_params()
        if self.distributed:  # the other DP ranks' shards of the restored parameters
            self.model.ddp.start_param_sync(force_sync=True)

    def gather_params(self) -> None:
        """Complete the parameter all-gather that ``overlap_param_gather`` defers to the next
        forward; call before reading parameters outside a forward (reshard, save, export).
        Without the overlap, ``step()`` has already gathered them and this does nothing."""
        if self.model.ddp_options.overlap_param_gather:
            self.model.ddp.start_param_sync(force_sync=True)

    def zero_grad(self) -> None:
        self.model.ddp.zero_grad_buffer()  # the fp32 main_grad buffers
        self.optimizer.zero_grad()

    def finalize_grads(self) -> None:
        """megatron's finalize: DP reduction of the DDP buffers (all-reduce, or reduce-scatter
        for the distributed optimizer), tied-embedding sum over embd."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model.ddp], pg_collection=self.model.pg_collection)

    def step(self) -> dict[str, float]:
        """Finalize, clip and apply the gradients; returns grad_norm (before clipping), lr and
        ``skipped`` (1.0 when the update was not applied: a non-finite gradient norm, or an
        fp16 loss-scale overflow). The norm is reduced over every rank that shares the update,
        so all ranks skip together and non-finite values never reach the weights."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self.finalize_grads()
        lr = lr_at(self.cfg, self.step_count) * self.lr_scale
        for group in self.optimizer.param_groups:  # what megatron's OptimizerParamScheduler sets
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)
        with cpu_compat.cuda_type_names(), torch.no_grad():
            if self.optimizer.prepare_grads():  # fp16 overflow: megatron lowers the scale
                return {"grad_norm": math.nan, "lr": lr, "skipped": 1.0}
            norm = float(self.optimizer.get_grad_norm())
            if not math.isfinite(norm):
                return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
            if self.cfg.grad_clip > 0:
                for part in self._parts:
                    params = part.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, max_norm=self.cfg.grad_clip,
                                                     total_norm=norm)
            self.optimizer.step_with_ready_grads()
        self.step_count += 1
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}


def _scaler(part):
    """The fp16 loss scaler of one of megatron's optimizers (None for fp32/bf16)."""
    return getattr(part, "grad_scaler", None)


def _mean_metrics(results: list[dict], groups, device) -> dict[str, float]:
    """Mean over micro-batches, then over DP ranks, of every scalar metric (last stage)."""
    keys = sorted(k for k, v in results[0].items() if torch.as_tensor(v).numel() == 1)
    local = torch.tensor([[float(r[k]) for k in keys] for r in results],
                         dtype=torch.float64, device=device).mean(dim=0)  # NCCL needs the GPU
    if groups.dp_size > 1:
        dist.all_reduce(local, group=groups.dp)
        local /= groups.dp_size
    return dict(zip(keys, local.tolist()))


def train_step(model: ShardedModel, optimizer: ModelOptimizer, microbatches, loss_fn,
               **forward_options) -> dict[str, float]:
    """Forward/backward over ``microbatches`` with ``loss_fn``, then one optimizer step."""
    optimizer.zero_grad()
    model.module.train()
    results = run_microbatches(model, microbatches, loss_fn, forward_only=False,
                               **forward_options)
    last = model.groups.is_last_stage
    metrics = _mean_metrics(results, model.groups, model.device) if last else None
    metrics = broadcast_from_last_stage(metrics, model.groups)
    return {**metrics, **optimizer.step()}
