"""RMSNorm over the last dim: the fused CPU kernel with autograd, ``F.rms_norm`` everywhere else.

Contract:
- ``rms_norm(x, weight=None, eps=None) -> Tensor``: ``x / sqrt(mean(x^2, -1) + eps) * weight`` over
  the last dim of ``x`` (any leading shape, any strides), in ``x``'s dtype; ``weight`` is None or
  1-D of size ``x.shape[-1]``. ``eps=None`` is what ``F.rms_norm`` takes then: the machine epsilon
  of the math dtype (fp32 for fp32/bf16/fp16 inputs, fp64 for fp64).
- It runs the compiled ops ``hybridrl::rms_norm_fwd`` / ``rms_norm_bwd`` (csrc/cpu/rmsnorm_cpu.cpp:
  one fused pass per row forward, one fused backward; fp32 math, bf16/fp16 widened per row) when
  ``x`` is a CPU tensor of fp32/bf16/fp16, ``weight`` is None or a CPU tensor of ``x``'s dtype or
  fp32 (megatron's local spec keeps norm weights in fp32 under bf16 activations; the weight
  gradient then comes back in fp32) and the extension is built (and not turned off by
  ``HYBRIDRL_KERNELS=reference``). The output is ``(x * rstd) * weight`` in fp32, rounded once to
  ``x``'s dtype (torch's mixed-dtype path rounds ``x * rstd`` to ``x``'s dtype before the weight:
  within 2 ulps of that dtype, tested). Otherwise (CUDA, fp64, other dtype mixes, no extension)
  it is ``F.rms_norm(x, (x.shape[-1],), weight, eps)`` itself, without a warning: that is the
  full-speed path there.
- Gradients flow to ``x`` and ``weight`` through a ``torch.autograd.Function``; under no_grad (or
  when neither input requires grad) the forward op is called directly, with no autograd node.
  A backward with ``create_graph=True`` (for a second derivative) runs torch's differentiable
  formula instead (``F.rms_norm`` recomputed from the saved inputs), so higher derivatives are
  torch's; the plain backward runs the fused op.
- ``FusedRMSNorm`` is ``torch.nn.RMSNorm`` (same parameter ``weight``, init, state_dict,
  ``extra_repr``) whose forward calls ``rms_norm``; a multi-dim ``normalized_shape`` is normalized
  as one flattened last dim (the same mean).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridrl.kernels import ops

__all__ = ["FusedRMSNorm", "rms_norm"]

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def default_eps(dtype: torch.dtype) -> float:
    """The epsilon ``F.rms_norm`` uses for ``eps=None``: that of the math dtype (fp32 below fp64)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _fused_ok(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    if x.device.type != "cpu" or x.dtype not in _FUSED_DTYPES or x.dim() == 0:
        return False
    if weight is not None and (weight.device.type != "cpu"
                               or weight.dtype not in (x.dtype, torch.float32)
                               or weight.shape != x.shape[-1:]):
        return False
    return ops.compiled_available("rms_norm_fwd", "cpu")


class _RMSNormFunction(torch.autograd.Function):
    """hybridrl::rms_norm_fwd, with hybridrl::rms_norm_bwd as its first-order backward."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = torch.ops.hybridrl.rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: torch's differentiable formula
            return (*_eager_backward(ctx, grad, x, weight), None)
        dx, dweight = torch.ops.hybridrl.rms_norm_bwd(grad, x, rstd, weight)
        return (dx if ctx.needs_input_grad[0] else None,
                dweight if ctx.needs_input_grad[1] else None, None)


def _eager_backward(ctx, grad, x, weight):
    """(dx, dweight) with a graph: F.rms_norm recomputed from the saved inputs and differentiated
    by torch, so higher derivatives are torch's own."""
    wanted = [t for t, need in zip((x, weight), ctx.needs_input_grad[:2]) if need]
    with torch.enable_grad():
        out = F.rms_norm(x, x.shape[-1:], weight, ctx.eps)
        grads = iter(torch.autograd.grad(out, wanted, grad, create_graph=True))
    return tuple(next(grads) if need else None for need in ctx.needs_input_grad[:2])


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim, times ``weight`` [x.shape[-1]] when given (module doc)."""
    if not _fused_ok(x, weight):
        return F.rms_norm(x, (x.shape[-1],) if x.dim() else (), weight, eps)
    eps = default_eps(x.dtype) if eps is None else float(eps)
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None
                                                        and weight.requires_grad)):
        return _RMSNormFunction.apply(x, weight, eps)
    return torch.ops.hybridrl.rms_norm_fwd(x, weight, eps)[0]


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose forward runs ``rms_norm`` (the fused CPU kernel where it applies).

    Parameters, init, state_dict and ``extra_repr`` are torch's; ``load_state_dict`` takes an
    ``nn.RMSNorm``'s state and the other way round.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        if k == 0 or tuple(x.shape[-k:]) != tuple(self.normalized_shape):
            return super().forward(x)  # torch's own error (or its no-op shape) stands
        if k == 1:
            return rms_norm(x, self.weight, self.eps)
        width = math.prod(self.normalized_shape)
        weight = None if self.weight is None else self.weight.reshape(width)
        return rms_norm(x.flatten(-k), weight, self.eps).reshape(x.shape)
