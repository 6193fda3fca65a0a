"""Weight-gradient accumulation fused into the backward GEMM for megatron DDP's ``main_grad``.

Contract:
- ``linear(input_, weight)`` returns ``F.linear(input_, weight)`` (``input_`` [..., in],
  ``weight`` [out, in], no bias; any number of leading dims). Its backward differs only in
  where the weight gradient goes, and only when ``fusable(input_, weight)``:
  * grad is enabled and ``weight.requires_grad``;
  * ``weight.main_grad`` is a tensor of the weight's shape on its device, and the weight has a
    ``grad_added_to_main_grad`` attribute (megatron's ``DistributedDataParallel`` sets it to
    False on every parameter that requires grad, at construction and in ``zero_grad_buffer``);
  * ``input_``, ``weight`` and ``main_grad`` have one floating dtype, so that the BLAS call
    ``main_grad += grad_out^T @ input`` is exact accumulation in that dtype. bf16/fp16 weights
    with fp32 ``main_grad`` (megatron's ``grad_reduce_in_fp32``) would need a mixed-precision
    GEMM (apex's ``wgrad_gemm_accum_fp32``); plain torch has none, so they fall back.
  Otherwise it is ``F.linear`` itself (native autograd; the DDP hook adds ``weight.grad``).
- Fused path, on 2-D [tokens, features] views of the input and gradients (one GEMM per product,
  whatever the strides of the leading dims): forward ``F.linear(input_2d, weight)``; backward
  ``grad_input = grad_out_2d @ weight`` (only when the input needs a gradient) and
  ``weight.main_grad.addmm_(grad_out_2d.t(), input_2d)`` in place (no weight-gradient
  temporary, no separate add pass); then megatron's gradient-accumulation-fusion contract
  (``LinearWithGradAccumulationAndAsyncCommunication.backward``): ``weight.grad_added_to_main_grad``
  is set True and the returned weight gradient is a dummy, ``torch.empty`` of the weight's
  shape, or zeros when ``weight.zero_out_wgrad`` is True. megatron DDP's backward hook then skips
  its ``main_grad.add_(grad)`` (it adds only when the flag is False or ``zero_out_wgrad``) and
  drops the dummy. The flag stays True for the rest of the step, so every later micro-batch
  accumulates here too; ``zero_grad_buffer`` zeroes ``main_grad`` and resets the flag.
- Hence every use of a fused weight inside a backward must go through ``linear``, unless the
  weight has ``zero_out_wgrad`` (megatron sets it on a pipeline-stage-local tied
  embedding/output weight, whose embedding lookup adds a real gradient to the zero dummy that
  the hook then adds), and ``torch.autograd.grad`` with respect to a fused weight gives the
  dummy (its gradient is in ``main_grad``). ``main_grad`` is read at backward time.
- Numerics: equal to ``F.linear`` + autograd + ``main_grad.add_`` up to the rounding of one
  fused multiply-add instead of a product rounded before the add (fp32: ~1e-7 relative).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fusable(input_: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``linear`` accumulates the weight gradient straight into ``weight.main_grad``."""
    if not (torch.is_grad_enabled() and weight.requires_grad
            and hasattr(weight, "grad_added_to_main_grad")):
        return False
    main_grad = getattr(weight, "main_grad", None)
    return (isinstance(main_grad, torch.Tensor) and main_grad.shape == weight.shape
            and weight.dtype.is_floating_point
            and input_.dtype == weight.dtype == main_grad.dtype
            and input_.device == weight.device == main_grad.device)


class _LinearMainGrad(torch.autograd.Function):
    """``F.linear`` whose backward accumulates the weight gradient into ``weight.main_grad``."""

    # all three products on 2-D [tokens, features] views: one GEMM each, whatever the strides of
    # the leading dims (F.linear on a transposed [s, 1, h] runs one product per token)

    @staticmethod
    def forward(ctx, input_, weight):
        x2d = input_.reshape(-1, input_.shape[-1])
        ctx.save_for_backward(x2d, weight)
        ctx.input_shape = input_.shape
        return F.linear(x2d, weight).view(*input_.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_input = g2d.mm(weight).view(ctx.input_shape) if ctx.needs_input_grad[0] else None
        weight.main_grad.addmm_(g2d.t(), x2d)
        dummy = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        weight.grad_added_to_main_grad = True
        return grad_input, dummy(weight.shape, dtype=weight.dtype, device=weight.device)


def linear(input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(input_, weight)``; fused weight-gradient accumulation when ``fusable``."""
    if fusable(input_, weight):
        return _LinearMainGrad.apply(input_, weight)
    return F.linear(input_, weight)
