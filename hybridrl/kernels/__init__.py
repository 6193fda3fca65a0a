"""Fused RL kernels: KL penalties, masked GAE, masked whitening (compiled ops or references).

Public API (numerically verl's; see shared DESIGN.md "Semantics to match" and docs/kernels.md):
- ``kl_penalty(logprob, ref_logprob, kind) -> Tensor``: per-token KL estimate [*shape], with
  gradients for both inputs; ``kind`` in ``KL_KINDS``.
- ``gae(token_level_rewards, values, response_mask, gamma, lam) -> (advantages, returns)``:
  [B, T] each, no whitening, no grad.
- ``masked_whiten(values, mask) -> Tensor``: whitened [*shape] over the masked elements.
- ``rms_norm(x, weight, eps)``, ``FusedRMSNorm``: RMSNorm over the last dim, the fused CPU
  kernel with its backward (``hybridrl.kernels.norm``; ``F.rms_norm`` elsewhere).

The fused CPU gated-MLP activation and rotary embedding, ``swiglu(x)`` and
``apply_rope(x, cos, sin)``, live in ``hybridrl.kernels.swiglu`` (not re-exported here: the name
``swiglu`` would shadow that submodule).

Each call runs the compiled ``hybridrl::*`` op when it is built for the tensors' device, else the
pure-torch reference (``hybridrl.kernels.reference``) after a single RuntimeWarning.

Before either runs, every input is checked in one line each: a ``torch.Tensor`` (a numpy
array or a list is a ``TypeError`` naming the argument), all on one device (``ValueError``
naming both devices: the compiled op reads every input as if it were on the first one's, so a
mixed call would read memory it does not own), log-probs and values floating point (masks, and
GAE's rewards, may be bool, integer or floating), the shapes equal. Non-contiguous inputs are
fine: the ops copy them.
"""

from __future__ import annotations

import torch

from hybridrl.kernels import ops, reference
from hybridrl.kernels.norm import FusedRMSNorm, rms_norm
from hybridrl.kernels.reference import KL_KINDS, parse_kl_kind

__all__ = ["KL_KINDS", "FusedRMSNorm", "gae", "kl_penalty", "masked_whiten", "rms_norm"]


def _use_compiled(op: str, tensor: torch.Tensor) -> bool:
    if ops.compiled_available(op, tensor.device.type):
        return True
    ops.warn_fallback(tensor.device.type)
    return False


def _check_inputs(fn: str, masks: tuple[str, ...] = (), **inputs) -> None:
    """Every input a tensor, all on the first one's device, values floating (module docstring);
    ``masks`` name the inputs that may be bool or integer too (promoted by the caller)."""
    first_name, first = None, None
    for name, t in inputs.items():
        if not isinstance(t, torch.Tensor):
            kind = f"{type(t).__module__}.{type(t).__qualname__}".removeprefix("builtins.")
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {kind}")
        if first is None:
            first_name, first = name, t
        elif t.device != first.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but {first_name} is on "
                             f"{first.device}: every input must be on one device")
        if name not in masks and not t.dtype.is_floating_point:
            raise ValueError(f"{fn}: {name} must be floating point, got {t.dtype}")
        if name in masks and t.dtype.is_complex:
            raise ValueError(f"{fn}: {name} must be bool, integer or floating, got {t.dtype}")


def _check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_b} must have the shape of {name_a} {tuple(a.shape)}, "
                         f"got {tuple(b.shape)}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL penalty [*shape] between logprob and ref_logprob [*shape].

    kind: "k1"/"kl" (logp - ref), "abs", "k2"/"mse" (0.5 (logp - ref)^2), "k3"/"low_var_kl"
    (clamped exp(ref - logp) - (ref - logp) - 1); a trailing "+" keeps the value and takes k2's
    gradient. Differentiable in both inputs; the dtype is the promoted input dtype.
    """
    fwd_code, bwd_code = parse_kl_kind(kind)
    _check_inputs("kl_penalty", logprob=logprob, ref_logprob=ref_logprob)
    _check_same_shape("logprob", logprob, "ref_logprob", ref_logprob)
    if fwd_code == bwd_code == reference.KL_K1:
        return logprob - ref_logprob  # one subtraction: nothing to fuse, eager is optimal
    if not _use_compiled("kl_forward", logprob):
        return reference.kl_penalty_ref(logprob, ref_logprob, kind)
    dtype = torch.promote_types(logprob.dtype, ref_logprob.dtype)
    return torch.ops.hybridrl.kl_forward(logprob.to(dtype), ref_logprob.to(dtype),
                                         fwd_code, bwd_code)


def gae(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], returns [B, T]) by masked GAE, bootstrap 0, no whitening, no grad.

    Masked-out steps (mask 0, e.g. multi-turn observation tokens) pass the running value and
    advantage through unchanged; returns = advantages + values.
    """
    _check_inputs("gae", ("token_level_rewards", "response_mask"), values=values,
                  token_level_rewards=token_level_rewards, response_mask=response_mask)
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D [B, T], got shape {tuple(values.shape)}")
    _check_same_shape("values", values, "token_level_rewards", token_level_rewards)
    _check_same_shape("values", values, "response_mask", response_mask)
    dtype = torch.promote_types(token_level_rewards.dtype, values.dtype)
    if not _use_compiled("gae", values):  # the reference needs a float mask (1 - m) as well
        return reference.gae_ref(token_level_rewards, values, response_mask.to(dtype), gamma, lam)
    with torch.no_grad():
        return torch.ops.hybridrl.gae(token_level_rewards.to(dtype), values.to(dtype),
                                      response_mask.to(dtype), float(gamma), float(lam))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(values - mean) * rsqrt(var + 1e-8) [*shape]; mean and unbiased var over mask != 0.

    Raises ValueError when the mask sums to 0 or 1 (verl's behaviour). Differentiable through
    the reference; the compiled op is used when no input requires grad.
    """
    _check_inputs("masked_whiten", ("mask",), values=values, mask=mask)
    _check_same_shape("values", values, "mask", mask)
    needs_grad = torch.is_grad_enabled() and values.requires_grad
    if needs_grad or not _use_compiled("masked_whiten", values):
        return reference.masked_whiten_ref(values, mask)
    return torch.ops.hybridrl.masked_whiten(values, mask.to(values.dtype))
