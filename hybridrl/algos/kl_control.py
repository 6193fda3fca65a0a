"""KL coefficient controllers and the in-reward KL penalty (verl's ``algorithm.use_kl_in_reward``).

Contract:
- ``FixedKLController(kl_coef)``: ``value`` never changes.
- ``AdaptiveKLController(init_kl_coef, target_kl, horizon)`` (Ziegler et al. 2019):
  ``err = clip(current_kl / target_kl - 1, -0.2, 0.2); value *= 1 + err · n_steps / horizon``.
- Both expose ``value``, ``update(current_kl, n_steps)``, ``state_dict()``/``load_state_dict()``
  (plain floats, for checkpoints). ``build_kl_controller(kind, ...)`` builds one from config values.
- ``apply_kl_in_reward(scores_BT, old_logp_BT, ref_logp_BT, mask_BT, kl_ctrl, kl_penalty="kl")``:
  ``kl_BT = kl_penalty(old, ref)·mask``; ``rewards_BT = scores_BT - beta·kl_BT`` with ``beta`` read
  *before* the controller update; ``current_kl`` = mean over sequences of per-sequence masked token
  means; then ``kl_ctrl.update(current_kl, n_steps=B)``. Returns ``(rewards_BT, metrics)`` with
  ``actor/reward_kl_penalty`` (current_kl) and ``actor/reward_kl_penalty_coeff`` (beta). Given a
  ``dp_group``, current_kl and B are taken over the batch shards of all DP ranks.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from hybridrl.algos.masked import masked_mean
from hybridrl.kernels import kl_penalty as kernel_kl_penalty

KL_CTRL_TYPES = ("fixed", "adaptive")


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_ctrl.kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards ``target_kl``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"kl_ctrl.kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"kl_ctrl.target_kl must be > 0 (adaptive type), got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0 for the adaptive type, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


def build_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Controller for ``algorithm.kl_ctrl.type`` = fixed | adaptive."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("kl_ctrl.type='adaptive' needs kl_ctrl.target_kl and kl_ctrl.horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"kl_ctrl.type must be one of {list(KL_CTRL_TYPES)}, got {kind!r}")


@torch.no_grad()
def apply_kl_in_reward(
    token_level_scores_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    ref_logp_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
    dp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level rewards ``scores - beta·kl`` [B, T] and the KL metrics; updates ``kl_ctrl``.

    With ``dp_group`` each rank passes its shard of the batch: ``current_kl`` and ``n_steps`` are
    then taken over the whole batch (one all_reduce), so every rank's controller takes the same
    step as a single process holding the whole batch.
    """
    mask_BT = response_mask_BT.to(old_logp_BT.dtype)
    kl_BT = kernel_kl_penalty(old_logp_BT, ref_logp_BT, kl_penalty) * mask_BT  # [B, T]
    beta = kl_ctrl.value
    rewards_BT = token_level_scores_BT - beta * kl_BT
    seq_kl_B = masked_mean(kl_BT, mask_BT, dim=-1)  # [B] per-sequence token means
    n_seqs = torch.tensor(float(seq_kl_B.numel()), dtype=torch.float64, device=seq_kl_B.device)
    totals = torch.stack([seq_kl_B.sum().double(), n_seqs])  # [sum of sequence means, B]
    if dp_group is not None:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=dp_group)
    current_kl = float(totals[0] / totals[1]) if totals[1] > 0 else 0.0
    kl_ctrl.update(current_kl=current_kl, n_steps=int(totals[1]))
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return rewards_BT, metrics
