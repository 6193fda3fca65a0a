"""Rollout correction: truncated importance-sampling weights between the trainer and the engine.

Contract: the rollout engine samples with its own kernels (bf16, fused sampling), so its
log-probs ``engine_BT`` differ from the trainer's ``old_BT`` (the actor's forward before the
update) on the same tokens. ``rollout_is_weights(old_BT, engine_BT, mask_BT, level, cap)``
returns detached weights [B, T] that the policy loss multiplies into its per-token losses
before aggregation (verl's ``rollout_is_weights``; ``actor.rollout_is``):

- ``token``:    ``w_bt = min(exp(clamp(old_bt - engine_bt, -20, 20)), cap)``
- ``sequence``: ``w_b = min(exp(clamp(sum_t (old_bt - engine_bt)·m_bt, -20, 20)), cap)``,
  the same weight on every token of the sequence,

then ``w · m`` (padding gets 0). ``rollout_is_metrics`` reports ``rollout_corr/is_mean`` (over
valid tokens), ``is_max``, ``is_min``, ``is_truncated_frac`` (share of valid tokens whose
untruncated weight exceeded ``cap``) and ``rollout_corr/log_ppl_gap`` (masked mean of
``old - engine``). Pure: tensors in, tensors out, no grad.
"""

from __future__ import annotations

import torch

from hybridrl.algos.masked import masked_mean, masked_sum

ROLLOUT_IS_LEVELS = ("token", "sequence")
_BOUND = 20.0  # exp(20) ~ 4.9e8: log ratios are clamped there before exp, as verl does


@torch.no_grad()
def _untruncated(old_BT, engine_BT, mask_BT, level):
    log_ratio_BT = (old_BT - engine_BT).float()
    if level == "token":
        return torch.exp(log_ratio_BT.clamp(-_BOUND, _BOUND))
    if level == "sequence":
        seq_B = masked_sum(log_ratio_BT, mask_BT.float(), dim=-1)  # [B]
        return torch.exp(seq_B.clamp(-_BOUND, _BOUND)).unsqueeze(-1).expand_as(log_ratio_BT)
    raise ValueError(f"actor.rollout_is must be one of {list(ROLLOUT_IS_LEVELS)}; got {level!r}")


@torch.no_grad()
def rollout_is_weights(
    old_BT: torch.Tensor, engine_BT: torch.Tensor, mask_BT: torch.Tensor,
    level: str = "token", cap: float = 2.0,
) -> torch.Tensor:
    """Truncated IS weights [B, T] (see the module docstring), zero on padding, detached."""
    if cap <= 0:
        raise ValueError(f"actor.rollout_is_cap must be > 0; got {cap!r}")
    w_BT = _untruncated(old_BT, engine_BT, mask_BT, level).clamp(max=cap)
    return (w_BT * mask_BT.to(w_BT.dtype)).to(old_BT.dtype)


@torch.no_grad()
def rollout_is_metrics(
    old_BT: torch.Tensor, engine_BT: torch.Tensor, mask_BT: torch.Tensor,
    level: str = "token", cap: float = 2.0,
) -> dict[str, torch.Tensor]:
    """Metrics of the weights (keys in the module docstring); detached 0-dim tensors."""
    raw_BT = _untruncated(old_BT, engine_BT, mask_BT, level)
    w_BT = raw_BT.clamp(max=cap)
    valid = mask_BT.bool()
    if not bool(valid.any()):
        zero = torch.zeros((), dtype=torch.float32)
        return {k: zero for k in ("rollout_corr/is_mean", "rollout_corr/is_max",
                                  "rollout_corr/is_min", "rollout_corr/is_truncated_frac",
                                  "rollout_corr/log_ppl_gap")}
    m = mask_BT.float()
    return {
        "rollout_corr/is_mean": masked_mean(w_BT, m),
        "rollout_corr/is_max": w_BT[valid].max(),
        "rollout_corr/is_min": w_BT[valid].min(),
        "rollout_corr/is_truncated_frac": masked_mean((raw_BT > cap).float(), m),
        "rollout_corr/log_ppl_gap": masked_mean((old_BT - engine_BT).float(), m),
    }
