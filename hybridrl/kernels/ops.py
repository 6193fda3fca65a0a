"""Binding of the compiled ``hybridrl::*`` custom ops, with fake kernels and autograd.

Contract:
- ``hybridrl._C`` (C++ CPU kernels, always built when the compiler works) defines the op schemas and
  CPU kernels; ``hybridrl._C_cuda`` (built only against a CUDA torch with nvcc) adds CUDA kernels.
- ``load()`` imports them once and registers, on the Python side, a fake (meta) kernel for every
  op, so the ops trace under torch.compile; the autograd kernels of ``kl_forward`` and
  ``kl_backward`` are C++ (csrc/cpu/kl_autograd.cpp, kl_grad_autograd.cpp), so the op runs in
  a loss and is twice differentiable. An extension that is not built is not an error (the
  references serve); one that is there but fails to import (an undefined symbol, a torch it was
  not built against, a missing shared library) raises ``ExtensionLoadError`` carrying the
  import error, at every ``load()`` / ``compiled_available()`` (so at the first kernel call)
  unless ``HYBRIDRL_KERNELS=reference``; it is never swallowed into the fallback.
- Importing this module is light: it loads no ``torch._dynamo`` (nor sympy) and sets no
  environment variable or warnings filter. ``compiled_available`` is marked constant for
  torch.compile with the attribute ``torch.compiler.assume_constant_result`` sets, without
  importing dynamo to set it (tests/unit/test_kernels_import.py checks both).
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
  rms_norm_fwd(Tensor x, Tensor? weight, float eps, str isa="auto") -> (Tensor, Tensor),
  rms_norm_bwd(Tensor grad, Tensor x, Tensor rstd, Tensor? weight, str isa="auto")
      -> (Tensor, Tensor?), rms_norm_cpu_isa() -> str
      (csrc/cpu/rmsnorm_cpu.cpp, CPU only; wrapped by hybridrl/kernels/norm.py)
  swiglu_fwd(Tensor x) -> Tensor, swiglu_bwd(Tensor grad, Tensor x) -> Tensor,
  rope_fwd(Tensor x, Tensor cos, Tensor sin) -> Tensor,
  rope_bwd(Tensor grad, Tensor cos, Tensor sin) -> Tensor, swiglu_cpu_isa() -> str
      (csrc/cpu/swiglu_cpu.cpp, CPU only; wrapped by hybridrl/kernels/swiglu.py)
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

OP_NAMES = ("kl_forward", "kl_backward", "gae", "masked_whiten")
# HYBRIDRL_KERNELS=reference (set before the first kernel call) forces the pure-torch references
FORCE_REFERENCE_ENV = "HYBRIDRL_KERNELS"


class ExtensionLoadError(RuntimeError):
    """A compiled extension is installed but cannot be imported (the import error is kept)."""


def _import_extension(name: str) -> bool:
    """Import ``hybridrl.<name>``: True when it loaded, False when it is not built at all;
    ``ExtensionLoadError`` (one line, with the import error) when it is there but broken."""
    try:
        importlib.import_module(f"hybridrl.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"hybridrl.{name}":
            return False  # not built: the references serve
        cause: Exception = err
    except (ImportError, OSError) as err:  # e.g. "undefined symbol", a missing libcudart
        cause = err
    else:
        return True
    raise ExtensionLoadError(
        f"hybridrl.kernels: the compiled extension hybridrl.{name} is installed but failed to "
        f"load: {type(cause).__name__}: {cause} (rebuild with `pip install --no-build-isolation "
        f"-e .`, or set {FORCE_REFERENCE_ENV}=reference / kernels.use_compiled=false to run the "
        "pure-torch references)") from cause


@functools.cache
def load() -> bool:
    """Import the compiled extension(s) and register the Python-side pieces; False if unbuilt.

    Raises ``ExtensionLoadError`` (not cached: every call raises it again) when an extension is
    installed but fails to import."""
    if not _import_extension("_C"):  # registers schemas + CPU kernels
        return False
    _import_extension("_C_cuda")  # registers CUDA kernels (absent on a CPU-only build)
    _register_fake_kernels()  # the autograd kernel of kl_forward is C++ (csrc/cpu/kl_autograd.cpp)
    _register_norm_fake_kernels()
    return True


def _register_norm_fake_kernels() -> None:
    """Fake kernels of the RMSNorm ops (csrc/cpu/rmsnorm_cpu.cpp; hybridrl/kernels/norm.py), when
    the built extension has them (an older build lacks them: rms_norm then runs F.rms_norm)."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("hybridrl::rms_norm_fwd", "CPU"):
        return

    @torch.library.register_fake("hybridrl::rms_norm_fwd")
    def _rms_norm_fwd_fake(x, weight, eps, isa="auto"):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        return out, x.new_empty(x.shape[:-1], dtype=torch.float32)

    @torch.library.register_fake("hybridrl::rms_norm_bwd")
    def _rms_norm_bwd_fake(grad, x, rstd, weight, isa="auto"):
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        return dx, None if weight is None else torch.empty_like(weight)


def compiled_available(op: str, device_type: str) -> bool:
    """True when ``hybridrl::op`` has a compiled kernel for ``device_type`` ("cpu", "cuda").

    Raises ``ExtensionLoadError`` when an extension is installed but broken (module doc)."""
    return _compiled_available(op, device_type)  # dynamo takes the result as a constant


# what torch.compiler.assume_constant_result(compiled_available) does, without importing
# torch._dynamo (and sympy, and inductor's environment) at import (module doc)
compiled_available._dynamo_marked_constant = True  # type: ignore[attr-defined]


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

    # fused SwiGLU / RoPE (csrc/cpu/swiglu_cpu.cpp; hybridrl/kernels/swiglu.py): contiguous
    # outputs; an older build lacks the ops (the wrappers then run eager torch)
    if not torch._C._dispatch_has_kernel_for_dispatch_key("hybridrl::swiglu_fwd", "CPU"):
        return

    @torch.library.register_fake("hybridrl::swiglu_fwd")
    def _swiglu_fwd_fake(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    @torch.library.register_fake("hybridrl::swiglu_bwd")
    def _swiglu_bwd_fake(grad, x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("hybridrl::rope_fwd")
    def _rope_fwd_fake(x, cos, sin):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("hybridrl::rope_bwd")
    def _rope_bwd_fake(grad, cos, sin):
        return torch.empty_like(grad, memory_format=torch.contiguous_format)
