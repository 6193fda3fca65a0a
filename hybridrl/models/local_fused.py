"""The local spec's norms and gated MLP on hybridrl's fused kernels (``hybridrl.kernels``).

Contract:
- ``SequenceParallelNorm(config, hidden_size, eps)`` (the layers' two norms and, through
  ``hybridrl.models.cpu_compat``, the block's final norm) and ``QKNorm`` (Qwen3's per-head q/k
  norms) build megatron's torch norm: ``WrappedTorchNorm``'s module and checks when sequence
  parallelism is off, a ``torch.nn.RMSNorm`` otherwise (``WrappedTorchNorm`` refuses SP; the
  layer norms' weights then carry megatron's ``sequence_parallel`` attribute, so
  ``finalize_model_grads`` all-reduces their gradients over TP; q/k norms normalize heads, not
  the sequence, and megatron reduces their gradients by name). Every RMSNorm is a
  ``hybridrl.kernels.norm.FusedRMSNorm``: a ``torch.nn.RMSNorm`` subclass with the same
  parameter, init and state dict whose forward runs the fused CPU op (one pass forward, one
  backward) on CPU tensors and ``F.rms_norm`` elsewhere. LayerNorm configs are megatron's,
  unchanged.
- ``LeanMLP`` (``make_mlp_lean(mlp)`` swaps a built ``MLP``'s class, as the lean transformer
  layer does for its dense MLP): megatron's ``MLP``; in the plain case (gated SiLU, no fused
  bias-activation, no TE activation, no clamp or GLU offset, no per-token scale) the forward
  is fc1 -> (+ bias) -> ``hybridrl.kernels.swiglu.swiglu`` (silu of the first half times the
  second, one fused op with its backward on CPU) -> fc2: megatron's products in one pass.
  Anything else calls megatron's forward unchanged.
- Numerics: tests/distributed/test_models_local_spec.py (whole models against megatron's own
  local spec, fp32 and bf16) and the kernels' own tests (tests/unit/test_kernels_*.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from hybridrl.kernels.norm import FusedRMSNorm
from hybridrl.kernels.swiglu import swiglu


def _torch_norm(config, hidden_size: int, eps: float, kwargs: dict, what: str) -> torch.nn.Module:
    """megatron's torch norm, a ``FusedRMSNorm`` when it is an RMSNorm; under sequence
    parallelism (which ``WrappedTorchNorm`` refuses) an RMSNorm only (``what``: the error's
    words before "RMSNorm")."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if config.sequence_parallel:
        if config.normalization != "RMSNorm":
            raise ValueError(f"{what} RMSNorm, got {config.normalization}")
        return FusedRMSNorm(normalized_shape=hidden_size, eps=eps)
    norm = WrappedTorchNorm(config, hidden_size, eps, **kwargs)
    if type(norm) is torch.nn.RMSNorm:  # FusedRMSNorm adds no state: the same module, fused
        norm.__class__ = FusedRMSNorm
    return norm


class SequenceParallelNorm:
    """megatron's torch RMSNorm that allows sequence parallelism (see the module docstring)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        norm = _torch_norm(config, hidden_size, eps, kwargs,
                           "model.sequence_parallel on the local spec needs")
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True  # grads all-reduced over TP (finalize_model_grads)
        return norm


class QKNorm:
    """Qwen3's per-head q/k RMSNorm on the local spec (see the module docstring)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        return _torch_norm(config, hidden_size, eps, kwargs,
                           "q/k norms with model.sequence_parallel on the local spec need")


class LeanMLP(MLP):
    """megatron's MLP; the plain gated-SiLU forward calls the fused SwiGLU op.

    Not put in the spec (megatron's TransformerLayer hands its TP group only to ``MLP`` itself):
    ``make_mlp_lean`` turns a built ``MLP`` into this class, which adds no parameter, buffer or
    hook."""

    def _set_lean(self) -> None:
        cfg = self.config
        self.lean = (cfg.gated_linear_unit and self.activation_func is F.silu
                     and cfg.activation_func is F.silu
                     and not getattr(cfg, "use_te_activation_func", False)
                     and not cfg.bias_activation_fusion
                     and getattr(cfg, "activation_func_clamp_value", None) is None
                     and not getattr(cfg, "glu_linear_offset", 0.0))

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        # megatron's own layer forward (sequence parallel, recompute) passes padding_mask, so it
        # keeps megatron's eager GLU: hybridrl.planning.memory's selective/full activation
        # counts are measured on that path (the fused op there shrinks selective's peak ~35 %)
        if not self.lean or per_token_scale is not None or kwargs:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(swiglu(intermediate))


def make_mlp_lean(mlp: torch.nn.Module) -> bool:
    """Give a megatron ``MLP`` (exactly that class) ``LeanMLP``'s forward; True when it did."""
    if type(mlp) is not MLP:
        return False
    mlp.__class__ = LeanMLP
    mlp._set_lean()
    return True
