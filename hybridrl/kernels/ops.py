"""Binding of the compiled ``hybridrl::*`` custom ops, with fake kernels and autograd.

Contract:
- ``hybridrl._C`` (C++ CPU kernels, always built when the compiler works) defines the op schemas and
  CPU kernels; ``hybridrl._C_cuda`` (built only against a CUDA torch with nvcc) adds CUDA kernels.
- ``load()`` imports them once and registers, on the Python side, a fake (meta) kernel for every
  op, so the ops trace under torch.compile; the autograd kernels of ``kl_forward`` and
  ``kl_backward`` are C++ (csrc/cpu/kl_autograd.cpp, kl_grad_autograd.cpp), so the op runs in
  a loss and is twice differentiable.
- ``kl_cpu_isa()`` names the SIMD path the compiled CPU KL kernels run: "avx512", "avx2" or
  "baseline" (SSE2 on x86-64, NEON on aarch64), the best this CPU has unless the environment
  variable ``HYBRIDRL_CPU_ISA`` (read once, at the first KL call) forces one; None when the
  compiled CPU kernels are not in use.
- ``compiled_available(op, device_type)`` says whether a compiled kernel exists for that device;
  when it does not, ``warn_fallback`` emits one warning per device type and callers use the
  pure-torch references of ``hybridrl.kernels.reference``. The environment variable
  ``HYBRIDRL_KERNELS=reference`` (read at the first call) forces the references
  (``kernels.use_compiled=false``).

Op schemas (see csrc/ops.cpp):
  kl_forward(Tensor logprob, Tensor ref_logprob, int fwd_kind, int bwd_kind) -> Tensor
  kl_backward(Tensor grad, Tensor logprob, Tensor ref_logprob, int bwd_kind) -> Tensor
      (the gradient w.r.t. logprob; w.r.t. ref_logprob it is its negation: every estimator is a
      function of logprob - ref_logprob)
  gae(Tensor rewards, Tensor values, Tensor mask, float gamma, float lam) -> (Tensor, Tensor)
  masked_whiten(Tensor values, Tensor mask) -> Tensor
  kl_cpu_isa() -> str
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

OP_NAMES = ("kl_forward", "kl_backward", "gae", "masked_whiten")
# HYBRIDRL_KERNELS=reference (set before the first kernel call) forces the pure-torch references
FORCE_REFERENCE_ENV = "HYBRIDRL_KERNELS"


@functools.cache
def load() -> bool:
    """Import the compiled extension(s) and register the Python-side pieces; False if unbuilt."""
    try:
        from hybridrl import _C  # noqa: F401  (registers schemas + CPU kernels)
    except ImportError:
        return False
    try:
        from hybridrl import _C_cuda  # noqa: F401  (registers CUDA kernels)
    except ImportError:
        pass
    _register_fake_kernels()  # the autograd kernel of kl_forward is C++ (csrc/cpu/kl_autograd.cpp)
    return True


@torch.compiler.assume_constant_result
def compiled_available(op: str, device_type: str) -> bool:
    """True when ``hybridrl::op`` has a compiled kernel for ``device_type`` ("cpu", "cuda")."""
    return _compiled_available(op, device_type)  # dynamo takes the result as a constant


@functools.cache
def _compiled_available(op: str, device_type: str) -> bool:
    if os.environ.get(FORCE_REFERENCE_ENV) == "reference":  # kernels.use_compiled=false
        return False
    if not load():
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"hybridrl::{op}", key)


def kl_cpu_isa() -> str | None:
    """"avx512", "avx2" or "baseline": the SIMD path of the compiled CPU KL kernels; else None.

    Raises ValueError when HYBRIDRL_CPU_ISA names a path this CPU cannot run.
    """
    if not _compiled_available("kl_forward", "cpu"):
        return None
    return torch.ops.hybridrl.kl_cpu_isa()


@functools.cache
def warn_fallback(device_type: str) -> None:
    """Warn once per device type that the pure-torch references are in use."""
    warnings.warn(
        f"hybridrl.kernels: compiled ops are not available for device {device_type!r}; "
        "using the pure-torch references (slower, same numbers). Rebuild with "
        "`pip install --no-build-isolation -e .` to get the csrc kernels.",
        RuntimeWarning,
        stacklevel=4,
    )


def _register_fake_kernels() -> None:
    @torch.library.register_fake("hybridrl::kl_forward")
    def _kl_forward_fake(logprob, ref_logprob, fwd_kind, bwd_kind):
        return torch.empty_like(logprob, memory_format=torch.contiguous_format)

    @torch.library.register_fake("hybridrl::kl_backward")
    def _kl_backward_fake(grad, logprob, ref_logprob, bwd_kind):
        return torch.empty_like(logprob, memory_format=torch.contiguous_format)

    @torch.library.register_fake("hybridrl::gae")
    def _gae_fake(rewards, values, mask, gamma, lam):
        out = torch.empty_like(values, memory_format=torch.contiguous_format)
        return out, torch.empty_like(out)

    @torch.library.register_fake("hybridrl::masked_whiten")
    def _masked_whiten_fake(values, mask):
        return torch.empty_like(values, memory_format=torch.contiguous_format)
