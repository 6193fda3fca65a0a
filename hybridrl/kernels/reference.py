"""Pure-torch references for the csrc kernels: the readable specification and the test oracle.

Contract: every function here computes exactly what verl computes (see shared DESIGN.md,
"Semantics to match"), op for op, in the dtype of its inputs, so a user switching from verl sees
the same numbers. The compiled ops in ``hybridrl._C`` must agree with these functions (fp32:
within 1e-6; bf16/fp16: against the reference evaluated in fp32 on the same inputs).

- ``kl_penalty_ref(logprob, ref_logprob, kind)``: per-token KL estimate, differentiable in both
  inputs; ``kind`` in ``KL_KINDS`` (k1/kl, abs, k2/mse, k3/low_var_kl, each optionally with "+").
- ``gae_ref(token_level_rewards, values, response_mask, gamma, lam)``: (advantages, returns), no
  whitening, no grad; the verl reverse time-step loop.
- ``masked_whiten_ref(values, mask)``: (values - mean) * rsqrt(var + 1e-8) with the masked mean and
  the unbiased masked variance over the whole tensor; ValueError when the mask sums to 0 or 1.
"""

from __future__ import annotations

import torch

# Canonical estimator codes shared with csrc (kl_kind in csrc/kl.h): k1, abs, k2, k3.
KL_K1, KL_ABS, KL_K2, KL_K3 = 0, 1, 2, 3
_KIND_CODES = {"k1": KL_K1, "kl": KL_K1, "abs": KL_ABS, "k2": KL_K2, "mse": KL_K2,
               "k3": KL_K3, "low_var_kl": KL_K3}
KL_KINDS = tuple(sorted(list(_KIND_CODES) + [k + "+" for k in _KIND_CODES]))

KL_CLAMP = 20.0  # |ref - logp| clamp inside k3
KLD_CLAMP = 10.0  # k3 output clamp
WHITEN_EPS = 1e-8


def parse_kl_kind(kind: str) -> tuple[int, int]:
    """(forward_code, backward_code) for ``kind``; a trailing "+" takes k2's gradient."""
    if not isinstance(kind, str) or kind.rstrip("+") not in _KIND_CODES or kind.count("+") > 1:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    code = _KIND_CODES[kind.rstrip("+")]
    return code, (KL_K2 if kind.endswith("+") else code)


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, code: int) -> torch.Tensor:
    if code == KL_K1:
        return logprob - ref_logprob
    if code == KL_ABS:
        return (logprob - ref_logprob).abs()
    if code == KL_K2:
        return 0.5 * (logprob - ref_logprob).square()
    kl = torch.clamp(ref_logprob - logprob, min=-KL_CLAMP, max=KL_CLAMP)
    kld = torch.exp(kl) - kl - 1
    return torch.clamp(kld, min=-KLD_CLAMP, max=KLD_CLAMP)


def kl_penalty_ref(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL penalty [*shape] of logprob, ref_logprob [*shape] (verl's ``kl_penalty``)."""
    fwd_code, bwd_code = parse_kl_kind(kind)
    forward_score = _kl_forward(logprob, ref_logprob, fwd_code)
    if fwd_code == bwd_code:
        return forward_score
    # Straight-through: the value of the estimator, the gradient of k2.
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


@torch.no_grad()
def gae_ref(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
            gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], returns [B, T]) by verl's reverse loop; masked-out steps carry forward.

    Bootstrap value 0 after the last token. A step with mask 0 neither consumes a value nor a TD
    error: ``nextv`` and ``last`` pass through it unchanged (multi-turn observation tokens).
    """
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        m_t = response_mask[:, t]
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * m_t + (1 - m_t) * nextvalues
        lastgaelam = lastgaelam_ * m_t + (1 - m_t) * lastgaelam
        advantages_reversed.append(lastgaelam)
    if not advantages_reversed:  # T == 0
        advantages = torch.zeros_like(values)
    else:
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages, returns


def masked_sum_ref(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    valid = torch.where(mask.bool(), values, 0.0)  # NaN outside the mask must not leak in
    return (valid * mask).sum(axis=axis)


def masked_mean_ref(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    return masked_sum_ref(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def masked_var_ref(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased masked variance over all elements; ValueError if the mask sums to 0 or 1."""
    mean = masked_mean_ref(values, mask)
    variance = masked_mean_ref((values - mean) ** 2, mask)
    mask_sum = mask.sum()
    if mask_sum == 0:
        raise ValueError("mask: at least one element of the mask has to be 1")
    if mask_sum == 1:
        raise ValueError("mask: the mask sums to one, the unbiased variance is undefined")
    return variance * (mask_sum / (mask_sum - 1))


def masked_whiten_ref(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(values - mean) * rsqrt(var + 1e-8) [*shape], statistics over the masked elements."""
    mean, var = masked_mean_ref(values, mask), masked_var_ref(values, mask)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS)
