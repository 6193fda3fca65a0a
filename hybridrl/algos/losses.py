"""PPO loss terms as pure functions of [B, T] tensors, and the policy-loss registry.

Each term is aggregated by ``agg_loss(loss_agg_mode, norm)`` (see ``hybridrl.algos.agg``) and
returns ``(loss, metrics)``; metric values are detached 0-dim tensors keyed as in DESIGN.md.

- ``vanilla`` policy loss (registered in ``POLICY_LOSSES``), with ``r = exp(clamp(logp - old,
  -20, 20))``, ``lo/hi = clip_ratio_low/high`` (default ``clip_ratio``), ``c = clip_ratio_c`` > 1:
  ``l1 = -A·r``, ``l2 = -A·clip(r, 1-lo, 1+hi)``, ``l = max(l1, l2)``; for ``A < 0`` the dual clip
  ``l = min(l, -A·c)``. Metrics: ``actor/pg_clipfrac`` (masked mean of ``l2 > l1``),
  ``actor/ppo_kl`` (masked mean of ``old - logp`` after the clamp), ``actor/pg_clipfrac_lower``
  (masked mean of ``l > -A·c`` where ``A < 0``).
- ``gspo`` policy loss (GSPO, verl's ``compute_policy_loss_gspo``): one ratio per sequence,
  ``s_b = exp(sum_t (logp - old)·m / max(n_b, 1))`` (the geometric mean of the token ratios),
  used per token as ``log s_bt = logp_bt - sg(logp_bt) + sg(log s_b)`` clamped at 10 (value
  ``s_b``, gradient ``s_b·∇logp_bt``); ``l = max(-A·s, -A·clip(s, 1-lo, 1+hi))``, no dual clip.
  Its policy term is always aggregated ``seq-mean-token-mean`` (verl's GSPO ignores
  ``loss_agg_mode`` too; the entropy and KL terms still follow it). The GSPO paper's ranges are
  ``lo = 3e-4``, ``hi = 4e-4`` (examples/gspo_qwen3_8b.yaml). ``actor/pg_clipfrac_lower`` is 0.
- Both take ``rollout_is_weights`` [B, T] (``hybridrl.algos.rollout_correction``): multiplied
  into the per-token losses before aggregation, as verl does.
- ``value_loss``: ``0.5·agg(max((v-R)², (clip(v, old-ε, old+ε)-R)²))``; ``critic/vf_loss``,
  ``critic/vf_clipfrac`` (masked mean of clipped > unclipped), ``critic/vpred_mean``.
- ``entropy_loss``: ``agg(entropy_BT)``; ``actor/entropy``.
- ``kl_loss``: ``agg(hybridrl.kernels.kl_penalty(logp, ref, kl_loss_type))``; ``actor/kl_loss``.
- ``actor_loss``: ``pg_loss - entropy_coeff·entropy + kl_loss_coef·kl_loss`` (verl's actor update)
  with all the metrics above plus ``actor/pg_loss`` and ``actor/kl_coef``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from hybridrl.algos.agg import AggNormalizers, agg_loss, check_agg_mode
from hybridrl.algos.masked import masked_mean
from hybridrl.algos.rollout_correction import rollout_is_metrics, rollout_is_weights
from hybridrl.kernels import kl_penalty as kernel_kl_penalty
from hybridrl.registry import Registry, call_with_accepted_kwargs

Metrics = dict[str, torch.Tensor]
POLICY_LOSSES = Registry("policy loss")


def register_policy_loss(name: str, *, override: bool = False) -> Callable:
    """Decorator: ``@register_policy_loss("my_loss")``; the function returns (loss, metrics)."""
    return POLICY_LOSSES.register(name, override=override)


def _weighted_agg(pg_losses_BT, weights_BT, mask_BT, loss_agg_mode, norm) -> torch.Tensor:
    """``agg(pg_losses · rollout IS weights)`` (the weights only when given)."""
    if weights_BT is not None:
        pg_losses_BT = pg_losses_BT * weights_BT
    return agg_loss(pg_losses_BT, mask_BT, loss_agg_mode, norm)


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    norm: AggNormalizers | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped PPO surrogate with dual clip; all tensors [B, T] (see the module docstring)."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    lo = clip_ratio if clip_ratio_low is None else clip_ratio_low
    hi = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio_BT = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio_BT = torch.exp(log_ratio_BT)
    loss1_BT = -advantages * ratio_BT
    loss2_BT = -advantages * torch.clamp(ratio_BT, 1.0 - lo, 1.0 + hi)
    clipped_BT = torch.maximum(loss1_BT, loss2_BT)
    loss3_BT = -advantages * clip_ratio_c
    negative_BT = advantages < 0
    pg_losses_BT = torch.where(negative_BT, torch.minimum(clipped_BT, loss3_BT), clipped_BT)
    pg_loss = _weighted_agg(pg_losses_BT, rollout_is_weights, response_mask, loss_agg_mode, norm)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean((loss2_BT > loss1_BT).float(), response_mask),
            "actor/ppo_kl": masked_mean(-log_ratio_BT, response_mask),
            "actor/pg_clipfrac_lower": masked_mean(
                ((clipped_BT > loss3_BT) & negative_BT).float(), response_mask
            ),
        }
    return pg_loss, metrics


@register_policy_loss("gspo")
def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 3e-4,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = 4e-4,
    norm: AggNormalizers | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO: sequence-level ratio and clipping; all tensors [B, T] (see the module docstring)."""
    lo = clip_ratio if clip_ratio_low is None else clip_ratio_low
    hi = clip_ratio if clip_ratio_high is None else clip_ratio_high
    mask_BT = response_mask.to(log_prob.dtype)
    log_ratio_BT = log_prob - old_log_prob
    seq_len_B = mask_BT.sum(dim=-1).clamp(min=1)
    seq_log_ratio_B = (log_ratio_BT * mask_BT).sum(dim=-1) / seq_len_B  # [B]
    log_s_BT = log_prob - log_prob.detach() + seq_log_ratio_B.detach().unsqueeze(-1)
    ratio_BT = torch.exp(torch.clamp(log_s_BT, max=10.0))
    loss1_BT = -advantages * ratio_BT
    loss2_BT = -advantages * torch.clamp(ratio_BT, 1.0 - lo, 1.0 + hi)
    pg_losses_BT = torch.maximum(loss1_BT, loss2_BT)
    pg_loss = _weighted_agg(pg_losses_BT, rollout_is_weights, response_mask,
                            "seq-mean-token-mean", norm)  # always, as verl's GSPO
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean((loss2_BT > loss1_BT).float(), response_mask),
            "actor/ppo_kl": masked_mean(-log_ratio_BT, response_mask),
            "actor/pg_clipfrac_lower": torch.zeros((), dtype=pg_loss.dtype),
        }
    return pg_loss, metrics


def compute_policy_loss(
    name: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    **options: Any,
) -> tuple[torch.Tensor, Metrics]:
    """(loss, metrics) of the policy loss registered as ``name``; options it does not name are
    dropped (clip_ratio*, loss_agg_mode, norm, ...)."""
    fn = POLICY_LOSSES.get(name)
    return call_with_accepted_kwargs(
        fn, old_log_prob, log_prob, advantages, response_mask, **options
    )


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    norm: AggNormalizers | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss ``0.5·agg(max((v-R)², (clip(v, old±ε)-R)²))``; all tensors [B, T]."""
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    vclipped_BT = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    loss1_BT = (vpreds - returns) ** 2
    loss2_BT = (vclipped_BT - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.max(loss1_BT, loss2_BT), response_mask, loss_agg_mode, norm)
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": vf_loss.detach(),
            "critic/vf_clipfrac": masked_mean((loss2_BT > loss1_BT).float(), response_mask),
            "critic/vpred_mean": masked_mean(vpreds, response_mask),
        }
    return vf_loss, metrics


def entropy_loss(
    entropy_BT: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    norm: AggNormalizers | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Aggregated per-token entropy (a bonus: the actor loss subtracts ``entropy_coeff·this``)."""
    ent = agg_loss(entropy_BT, response_mask, loss_agg_mode, norm)
    return ent, {"actor/entropy": ent.detach()}


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    norm: AggNormalizers | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-to-reference loss term (``use_kl_loss``) through ``hybridrl.kernels.kl_penalty``."""
    kl_BT = kernel_kl_penalty(log_prob, ref_log_prob, kl_loss_type)  # [B, T]
    kl = agg_loss(kl_BT, response_mask, loss_agg_mode, norm)
    return kl, {"actor/kl_loss": kl.detach()}


def actor_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    policy_loss: str = "vanilla",
    entropy_BT: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    ref_log_prob: torch.Tensor | None = None,
    use_kl_loss: bool = False,
    kl_loss_type: str = "low_var_kl",
    kl_loss_coef: float = 0.001,
    loss_agg_mode: str = "token-mean",
    norm: AggNormalizers | None = None,
    rollout_log_prob: torch.Tensor | None = None,
    rollout_is: str = "",
    rollout_is_cap: float = 2.0,
    **policy_options: Any,
) -> tuple[torch.Tensor, Metrics]:
    """Total actor loss ``pg - entropy_coeff·entropy + kl_loss_coef·kl`` and its metrics.

    ``rollout_is`` (``token`` | ``sequence``; "" = off) weights the policy loss by the truncated
    IS weights of ``old_log_prob`` against the engine's ``rollout_log_prob``
    (``hybridrl.algos.rollout_correction``) and adds their ``rollout_corr/*`` metrics; the
    policy loss must accept ``rollout_is_weights``.

    ``entropy_BT`` is required when ``entropy_coeff != 0`` (and reported whenever given);
    ``ref_log_prob`` is required when ``use_kl_loss``. ``policy_options`` go to the policy loss
    (clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c, ...).
    """
    check_agg_mode(loss_agg_mode)
    agg = {"loss_agg_mode": loss_agg_mode, "norm": norm}
    is_metrics: Metrics = {}
    if rollout_is:
        if rollout_log_prob is None:
            raise ValueError("rollout_log_prob [B, T] (the engine's) is required when "
                             f"actor.rollout_is={rollout_is!r}")
        if "rollout_is_weights" not in inspect.signature(POLICY_LOSSES.get(policy_loss)).parameters:
            raise ValueError(f"actor.rollout_is needs a policy loss that takes rollout_is_weights; "
                             f"{policy_loss!r} does not")
        args = (old_log_prob.detach(), rollout_log_prob, response_mask, rollout_is, rollout_is_cap)
        policy_options["rollout_is_weights"] = rollout_is_weights(*args)
        is_metrics = rollout_is_metrics(*args)
    pg, metrics = compute_policy_loss(
        policy_loss, old_log_prob, log_prob, advantages, response_mask, **agg, **policy_options
    )
    metrics = {"actor/pg_loss": pg.detach(), **metrics, **is_metrics}
    total = pg
    if entropy_coeff != 0 and entropy_BT is None:
        raise ValueError("entropy_BT [B, T] is required when entropy_coeff != 0")
    if entropy_BT is not None:
        ent, ent_metrics = entropy_loss(entropy_BT, response_mask, **agg)
        metrics.update(ent_metrics)
        if entropy_coeff != 0:
            total = total - entropy_coeff * ent
    if use_kl_loss:
        if ref_log_prob is None:
            raise ValueError("ref_log_prob [B, T] is required when use_kl_loss=True")
        kl, kl_metrics = kl_loss(log_prob, ref_log_prob, response_mask, kl_loss_type, **agg)
        metrics.update(kl_metrics)
        metrics["actor/kl_coef"] = torch.tensor(float(kl_loss_coef))
        total = total + kl_loss_coef * kl
    return total, metrics
