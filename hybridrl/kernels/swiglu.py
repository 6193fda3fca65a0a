"""Fused SwiGLU and RoPE for CPU training: the gated-MLP activation and the rotary embedding.

Contract:
- ``swiglu(x)``: ``x [..., 2f]`` holds megatron's fc1 output, gate half then up half; returns
  ``silu(x[..., :f]) * x[..., f:]`` [..., f], differentiable in x. A last dim that is odd is a
  ``ValueError``.
- ``apply_rope(x, cos, sin)``: ``x * cos + rotate_half(x) * sin`` with megatron's
  non-interleaved ``rotate_half(x) = cat(-x2, x1)`` over the halves of the last dim d (which must
  be even: ``ValueError`` otherwise); x is [t, ..., d] (e.g. [t, heads, d], [t, b, heads, d] or
  the local spec's [s, b, groups, heads, d] view of the QKV projection), cos/sin broadcast
  against it as ``hybridrl/models/local_spec.py`` builds them: [t or 1, 1, ..., 1, d] (leading 1s
  may be omitted), per token position for a pack. Differentiable in x (not in cos/sin).
- On CPU tensors of float32/bfloat16/float16 with the compiled extension built, both run the
  ``hybridrl::swiglu_fwd/bwd`` and ``hybridrl::rope_fwd/bwd`` ops (csrc/cpu/swiglu_cpu.cpp: one
  pass each way, fp32 math, rounded once for bf16/fp16) inside a ``torch.autograd.Function``;
  SwiGLU saves only x for the backward. Otherwise (CUDA, float64, cos/sin that need a gradient
  or broadcast another way, the extension not built or ``HYBRIDRL_KERNELS=reference``) the
  eager formula above runs unchanged. fp32 results equal eager torch's within ~1e-6 relative
  (SwiGLU: its own exp; RoPE: bit for bit); docs/kernels_layers.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridrl.kernels import ops

__all__ = ["apply_rope", "swiglu", "swiglu_cpu_isa"]

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOWP_MAX_D = 512  # the kernel's widest bf16/fp16 RoPE row


def swiglu_cpu_isa() -> str | None:
    """"avx512", "avx2" or "baseline": the SIMD path of the CPU SwiGLU/RoPE kernels; else None.

    ``HYBRIDRL_CPU_ISA`` (read at the first call) forces a path; one the CPU lacks raises
    ValueError naming those it has."""
    if not ops.compiled_available("swiglu_fwd", "cpu"):
        return None
    return torch.ops.hybridrl.swiglu_cpu_isa()


def _fused(op: str, x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in _FUSED_DTYPES
            and ops.compiled_available(op, "cpu"))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.ops.hybridrl.swiglu_fwd(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.hybridrl.swiglu_bwd(grad, x)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of ``x = gate | up`` [..., 2f] -> [..., f] (module docstring)."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim of x must be even (gate | up halves), got shape "
                         f"{tuple(x.shape)}")
    if not _fused("swiglu_fwd", x):
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * up
    if torch.is_grad_enabled() and x.requires_grad:
        return _SwiGLU.apply(x)
    return torch.ops.hybridrl.swiglu_fwd(x)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return torch.ops.hybridrl.rope_fwd(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return torch.ops.hybridrl.rope_bwd(grad, cos, sin), None, None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _table(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """cos or sin as [t or 1, 1, ..., 1, d] at x's rank, or None when it broadcasts otherwise."""
    if t.dim() > x.dim() or t.dtype != x.dtype or t.device != x.device or t.requires_grad:
        return None
    t = t.reshape((1,) * (x.dim() - t.dim()) + tuple(t.shape))
    if t.shape[-1] != x.shape[-1] or t.shape[0] not in (1, x.shape[0]):
        return None
    return t if all(n == 1 for n in t.shape[1:-1]) else None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, megatron's non-interleaved layout (module docstring)."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: the head dim (last dim of x) must be even, got shape "
                         f"{tuple(x.shape)}")
    c, s = (_table(cos, x), _table(sin, x)) if x.dim() >= 2 else (None, None)
    if (c is None or s is None or c.shape != s.shape or not _fused("rope_fwd", x)
            or (x.dtype != torch.float32 and x.shape[-1] > _LOWP_MAX_D)):
        return x * cos + _rotate_half(x) * sin
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, c, s)
    return torch.ops.hybridrl.rope_fwd(x, c, s)
