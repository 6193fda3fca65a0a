"""One optimizer step of a sharded model: micro-batches, DP sync, global-norm clip, AdamW + LR.

Contract:
- ``OptimConfig`` holds the knobs (``from_role_config`` reads hybridrl's actor/critic section);
  ``lr_at(cfg, step)`` is the pure LR schedule for the 0-based optimizer step ``step``:
  constant: ``lr``; warmup: ``lr * min(1, (step + 1) / warmup_steps)``; cosine: the same warmup,
  then ``lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)`` with ``r = min_lr_ratio`` and
  ``p = clamp((step + 1 - warmup) / (total_steps - warmup), 0, 1)``.
- ``ModelOptimizer(model, cfg)``: AdamW over the trainable parameters (no weight decay on 1-D
  parameters and biases; bf16/fp16 parameters are stepped through fp32 master copies). Gradients
  live in megatron DDP's fp32 ``param.main_grad`` buffers. ``step()`` finalizes, clips, applies:
  1. megatron's ``finalize_model_grads``: DP average over ``groups.dp`` (DDP's bucketed
     all-reduce) and, for tied embeddings with pp > 1, the sum of the word-embedding and
     output-layer gradients over the first/last-stage ``embd`` group;
  2. global norm: sum of squares of every parameter counted once (TP-split parameters on every
     TP rank, replicated ones on tp_rank 0, the last stage's tied copy never), all-reduced over the
     model-parallel (tp x pp) group; if ``grad_clip`` > 0 and the norm exceeds it, every gradient is
     scaled by ``grad_clip / (norm + 1e-6)`` (megatron's rule);
  3. AdamW with the learning rate ``lr_at(cfg, step_count)``.
  ``state_dict()`` / ``load_state_dict()`` save and restore this rank's optimizer state.
- ``train_step(model, optimizer, microbatches, loss_fn)`` runs ``forward.run_microbatches`` with
  the loss callback, then ``optimizer.step()``; it returns the metrics of the step on every rank:
  the mean over micro-batches and DP ranks of each scalar the callback reported (``loss``
  included), ``grad_norm`` (before clipping) and ``lr``. The objective is the mean of the
  callback's per-micro-batch losses over all micro-batches of all DP ranks.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from hybridrl.models.build import ShardedModel
from hybridrl.models.forward import broadcast_from_last_stage, run_microbatches
from hybridrl.models.naming import tp_partition_dim

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
    """AdamW over one ShardedModel (megatron DDP gradients) plus finalization and clipping."""

    def __init__(self, model: ShardedModel, cfg: OptimConfig):
        if model.role == "reference" or model.ddp is None:
            raise ValueError(f"the {model.role} model is frozen; it has no optimizer")
        self.model, self.cfg, self.step_count = model, cfg, 0
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        # bf16/fp16 parameters get fp32 master copies; AdamW runs on those
        self.masters = [p if p.dtype == torch.float32 else
                        torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        is_decay = [p.ndim > 1 and not n.endswith(".bias") for n, p in named]
        self.optimizer = torch.optim.AdamW(
            [{"params": [m for m, d in zip(self.masters, is_decay) if d],
              "weight_decay": cfg.weight_decay},
             {"params": [m for m, d in zip(self.masters, is_decay) if not d],
              "weight_decay": 0.0}],
            lr=lr_at(cfg, 0), betas=tuple(cfg.betas), eps=cfg.eps)

    def state_dict(self) -> dict:
        """AdamW state, fp32 masters (bf16/fp16 models) and the step count of this rank."""
        masters = [m.detach().clone() if m is not p else None
                   for p, m in zip(self.params, self.masters)]
        return {"optimizer": self.optimizer.state_dict(), "masters": masters,
                "step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        if len(state["masters"]) != len(self.masters):
            raise ValueError(f"optimizer state has {len(state['masters'])} parameters, this "
                             f"model shard has {len(self.masters)}")
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for master, saved in zip(self.masters, state["masters"]):
                if saved is not None:
                    master.copy_(saved)
        self.step_count = int(state["step_count"])

    def zero_grad(self) -> None:
        self.model.ddp.zero_grad_buffer()  # the fp32 main_grad buffers
        for p in self.params:
            p.grad = None

    def finalize_grads(self) -> None:
        """megatron's finalize: DP average of the DDP buffers, tied-embedding sum over embd."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model.ddp], pg_collection=self.model.pg_collection)

    def grad_norm(self) -> float:
        """Global L2 norm of the gradient, each parameter counted once across TP/PP."""
        groups = self.model.groups
        sq = torch.zeros((), dtype=torch.float64, device=self.model.device)
        for p in self.params:
            split = tp_partition_dim(p) is not None
            if (split or groups.tp_rank == 0) and not getattr(p, "shared", False):
                sq += p.main_grad.double().pow(2).sum()
        if groups.tp_size * groups.pp_size > 1:
            dist.all_reduce(sq, group=groups.mp)
        return math.sqrt(sq.item())

    def step(self) -> dict[str, float]:
        """Finalize, clip and apply the gradients; returns grad_norm (before clipping) and lr."""
        self.finalize_grads()
        norm = self.grad_norm()
        if self.cfg.grad_clip > 0 and norm > self.cfg.grad_clip:
            coeff = self.cfg.grad_clip / (norm + 1e-6)
            for p in self.params:
                p.main_grad.mul_(coeff)
        lr = lr_at(self.cfg, self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for p, master in zip(self.params, self.masters):
            master.grad = p.main_grad  # fp32 either way
        self.optimizer.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                master.grad = None
                if master is not p:
                    p.copy_(master)
        self.step_count += 1
        return {"grad_norm": norm, "lr": lr}


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
