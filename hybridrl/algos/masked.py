"""Masked reductions over [B, T] token tensors, and per-token entropy from logits.

Contract (matches verl's ``torch_functional`` numerics):
- ``masked_sum(x, m, dim)``: sum of ``x*m``; entries where ``m == 0`` count as 0 even if NaN/inf.
- ``masked_mean(x, m, dim)``: ``masked_sum / (sum(m) + 1e-8)``; an all-zero mask gives 0.
- ``masked_var(x, m, unbiased=True)``: mean of squared deviations from the masked mean, times
  ``n/(n-1)`` (Bessel) when unbiased; ValueError when the mask selects fewer than 2 entries.
- ``masked_whiten``: re-exported from ``hybridrl.kernels`` (``(x - mean)·rsqrt(var + 1e-8)`` with
  the unbiased masked variance); the kernels package owns its implementation.
- ``entropy_from_logits(logits_BTV) -> entropy_BT``: ``logsumexp(z) - sum(softmax(z)·z)``.
"""

from __future__ import annotations

import torch

from hybridrl.kernels import masked_whiten

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten", "entropy_from_logits"]


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of ``values*mask`` over ``dim`` (all dims when None); masked-out NaNs are ignored."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    if dim is None:
        return (kept * mask).sum()
    return (kept * mask).sum(dim=dim)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """``masked_sum / (mask.sum() + 1e-8)`` over ``dim`` (all dims when None)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of ``values`` (all dims); Bessel-corrected if unbiased."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(
                f"masked_var(unbiased=True) needs mask to select at least 2 entries, got {float(n)}"
            )
        var = var * (n / (n - 1))
    return var


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...]."""
    probs = torch.softmax(logits_BTV, dim=-1)
    return torch.logsumexp(logits_BTV, dim=-1) - (probs * logits_BTV).sum(dim=-1)
