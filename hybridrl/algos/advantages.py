"""Advantage estimators (no grad) and their registry.

Contract: an estimator is ``fn(token_level_rewards_BT, response_mask_BT, **inputs) ->
(advantages_BT, returns_BT)``, [B, T] each. ``compute_advantage(name, ...)`` looks ``name`` up in
``ADVANTAGE_ESTIMATORS`` and passes only the inputs the function's signature names (``values``,
``index``, ``gamma``, ``lam``, ``epsilon``, ``norm_adv_by_std_in_grpo`` and any extra keywords).
Add your own with ``@register_advantage_estimator("name")``.

Built in (verl's numbers):
- ``gae``: ``hybridrl.kernels.gae`` (bootstrap 0, masked steps pass through) then advantages
  masked-whitened over the whole batch (``hybridrl.kernels.masked_whiten``, unbiased var, eps
  1e-8); returns = advantages + values taken *before* whitening.
- ``grpo``: outcome score ``s_b = sum_t r_bt``; per group of ``index`` (prompt uid) the mean and
  unbiased std; a group of one uses mean 0, std 1. ``adv_b = (s_b - mean) / (std + epsilon)``
  (``epsilon`` 1e-6), or ``s_b - mean`` when ``norm_adv_by_std_in_grpo=False`` (Dr. GRPO);
  broadcast over valid tokens (``adv_b · m_bt``); returns = advantages.
- ``rloo``: ``adv_b = s_b·k/(k-1) - mean·k/(k-1)`` (score minus the mean of the other k-1 group
  members); a group of one keeps ``s_b``; broadcast over valid tokens; returns = advantages.
- ``reinforce_plus_plus``: return-to-go ``G_t = r_t + gamma·G_{t+1}`` with ``G`` reset to 0 after
  a masked step; advantages = masked_whiten(G)·m; returns = G.
- ``reinforce_plus_plus_baseline`` (REINFORCE++ with a group baseline): ``s_b - mean`` of its
  prompt group (a group of one: mean 0), broadcast over valid tokens, then masked-whitened over
  the batch and masked again; returns = advantages.
``gae``, ``reinforce_plus_plus`` and ``reinforce_plus_plus_baseline`` take ``whiten`` (default ``masked_whiten``): a batch shard
passes one with the whole batch's moments (``hybridrl.algos.dist_advantages``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridrl.kernels import gae as kernel_gae
from hybridrl.kernels import masked_whiten
from hybridrl.registry import Registry, call_with_accepted_kwargs

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")


def register_advantage_estimator(name: str, *, override: bool = False) -> Callable:
    """Decorator: ``@register_advantage_estimator("my_est")`` adds an estimator."""
    return ADVANTAGE_ESTIMATORS.register(name, override=override)


@register_advantage_estimator("gae")
@torch.no_grad()
def gae_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: Callable = masked_whiten,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE through the kernels, then batch-wide masked whitening of the advantages."""
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values [B, T] from the critic")
    adv_BT, returns_BT = kernel_gae(token_level_rewards, values, response_mask, gamma, lam)
    adv_BT = whiten(adv_BT, response_mask)
    return adv_BT, returns_BT


def group_ids(index: Sequence[Any] | torch.Tensor, batch_size: int) -> torch.Tensor:
    """Dense group id [B] (0..G-1, order of first appearance) for each entry of ``index``."""
    if len(index) != batch_size:
        raise ValueError(f"index must have one entry per sequence ({batch_size}), got {len(index)}")
    if isinstance(index, torch.Tensor):
        keys = index.tolist()
    else:
        keys = [k.item() if hasattr(k, "item") else k for k in index]
    first_seen: dict[Any, int] = {}
    return torch.tensor([first_seen.setdefault(k, len(first_seen)) for k in keys], dtype=torch.long)


def group_stats(
    scores_B: torch.Tensor, ids_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence group (mean, unbiased std, size) [B] each; a group of one: mean 0, std 1."""
    ids_B = ids_B.to(scores_B.device)
    n_groups = int(ids_B.max()) + 1 if ids_B.numel() else 0
    count_G = torch.bincount(ids_B, minlength=n_groups).to(scores_B.dtype)  # [G]
    sum_G = torch.zeros(n_groups, dtype=scores_B.dtype, device=scores_B.device)
    mean_G = sum_G.index_add(0, ids_B, scores_B) / count_G
    dev_B = scores_B - mean_G[ids_B]
    ssq_G = torch.zeros_like(sum_G).index_add(0, ids_B, dev_B * dev_B)
    std_G = torch.sqrt(ssq_G / (count_G - 1).clamp_min(1))
    single_G = count_G == 1
    mean_G = torch.where(single_G, torch.zeros_like(mean_G), mean_G)
    std_G = torch.where(single_G, torch.ones_like(std_G), std_G)
    return mean_G[ids_B], std_G[ids_B], count_G[ids_B]


@register_advantage_estimator("grpo")
@torch.no_grad()
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages normalized within each prompt group (see the module docstring)."""
    if index is None:
        raise ValueError("advantage estimator 'grpo' needs index: a group id (prompt uid) per row")
    scores_B = token_level_rewards.sum(dim=-1)  # [B]
    mean_B, std_B, _ = group_stats(scores_B, group_ids(index, scores_B.shape[0]))
    adv_B = scores_B - mean_B
    if norm_adv_by_std_in_grpo:
        adv_B = adv_B / (std_B + epsilon)
    adv_BT = adv_B.unsqueeze(-1) * response_mask.to(adv_B.dtype)  # [B, T]
    return adv_BT, adv_BT


@register_advantage_estimator("rloo")
@torch.no_grad()
def rloo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline: ``s_b - mean(others in the group)``; a group of one keeps ``s_b``."""
    if index is None:
        raise ValueError("advantage estimator 'rloo' needs index: a group id (prompt uid) per row")
    scores_B = token_level_rewards.sum(dim=-1)  # [B]
    mean_B, _, k_B = group_stats(scores_B, group_ids(index, scores_B.shape[0]))
    loo_B = scores_B * k_B / (k_B - 1) - mean_B * k_B / (k_B - 1)  # = s_b - mean of the others
    adv_B = torch.where(k_B > 1, loo_B, scores_B)
    adv_BT = adv_B.unsqueeze(-1) * response_mask.to(adv_B.dtype)  # [B, T]
    return adv_BT, adv_BT


@register_advantage_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
    whiten: Callable = masked_whiten,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted return-to-go (reset where the mask is 0), masked-whitened over the batch."""
    mask_BT = response_mask.to(token_level_rewards.dtype)
    returns_BT = torch.zeros_like(token_level_rewards)
    running_B = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running_B = token_level_rewards[:, t] + gamma * running_B
        returns_BT[:, t] = running_B
        running_B = running_B * mask_BT[:, t]
    return whiten(returns_BT, response_mask) * mask_BT, returns_BT


@register_advantage_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | torch.Tensor | None = None,
    whiten: Callable = masked_whiten,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score minus its group's mean, broadcast over valid tokens, whitened over the batch."""
    if index is None:
        raise ValueError("advantage estimator 'reinforce_plus_plus_baseline' needs index: a group "
                         "id (prompt uid) per row")
    scores_B = token_level_rewards.sum(dim=-1)  # [B]
    mean_B, _, _ = group_stats(scores_B, group_ids(index, scores_B.shape[0]))
    mask_BT = response_mask.to(scores_B.dtype)
    adv_BT = whiten((scores_B - mean_B).unsqueeze(-1) * mask_BT, response_mask) * mask_BT  # [B, T]
    return adv_BT, adv_BT


def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    index: Sequence[Any] | torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], returns [B, T]) from the estimator registered as ``name``."""
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            "token_level_rewards and response_mask must both be [B, T], got "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
        )
    fn = ADVANTAGE_ESTIMATORS.get(name)
    return call_with_accepted_kwargs(
        fn,
        token_level_rewards,
        response_mask,
        values=values,
        index=index,
        gamma=gamma,
        lam=lam,
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        **extra,
    )
