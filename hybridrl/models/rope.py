"""RoPE inverse frequencies exactly as transformers computes them from a config.json (torch).

Contract:
- ``inv_freq(head_dim, theta, scaling, max_position_embeddings)`` returns ``(inv_freq [hd/2]
  fp32, attention_factor)`` for plain RoPE (``scaling`` None) or a ``RopeScaling``
  (``hybridrl.config.hf_model``: llama3 with any keys, yarn), computed as transformers'
  ``ROPE_INIT_FUNCTIONS`` compute them (same fp32 ops in the same order, so equal bit for bit;
  tests/unit/test_models_rope.py checks it against the installed transformers).
  ``attention_factor`` multiplies cos and sin in transformers (1.0 except yarn); a model
  reproduces it by scaling the attention logits by its square (q and k are both rotated):
  ``softmax_scale = attention_factor**2 / sqrt(head_dim)``.

Formulas (``base = rope_theta``, ``d = head_dim``, ``f_i = base**(-2i/d)``, wavelength
``w_i = 2*pi/f_i``):
- llama3 (``factor`` s, ``low_freq_factor`` l, ``high_freq_factor`` h, old context ``c`` =
  ``original_max_position_embeddings``): ``f_i/s`` where ``w_i > c/l``; ``f_i`` where
  ``w_i < c/h``; between: ``(1 - k) f_i/s + k f_i`` with ``k = (c/w_i - l)/(h - l)``.
  megatron-core 0.16.1's ``RotaryEmbedding(rope_scaling=True)`` hard-codes l = 1, h = 4,
  c = 8192: right for Llama 3.1/3.2/3.3 as published, wrong for any other value.
- yarn (``factor`` s, ``beta_fast`` 32, ``beta_slow`` 1, ``c`` = ``original_max_position_
  embeddings`` or ``max_position_embeddings``): correction dims ``D(r) = d ln(c/(2 pi r)) /
  (2 ln base)``, ``lo = max(floor(D(beta_fast)), 0)``, ``hi = min(ceil(D(beta_slow)), d - 1)``
  (no floor/ceil when ``truncate`` is false), ramp ``m_i = clamp((i - lo)/(hi - lo), 0, 1)``,
  ``inv_freq_i = f_i/s * m_i + f_i * (1 - m_i)``; ``attention_factor`` given, else
  ``mscale(s, mscale)/mscale(s, mscale_all_dim)`` when both are set, else ``mscale(s)`` with
  ``mscale(s, m=1) = 0.1 m ln s + 1`` (1 for s <= 1).
"""

from __future__ import annotations

import math

import torch

from hybridrl.config.hf_model import ROPE_TYPES, RopeScaling


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    return 1.0 / (theta ** exponents)  # [hd/2] fp32


def _llama3(base_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / base_freq
    scaled = torch.where(wavelen > low_wavelen, base_freq / s.factor, base_freq)
    k = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - k) * scaled / s.factor + k * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling, max_positions: int):
    d = head_dim
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = float(_mscale(s.factor, s.mscale) / _mscale(s.factor, s.mscale_all_dim))
    else:
        attention = _mscale(s.factor)
    fast = s.beta_fast or 32
    slow = s.beta_slow or 1
    context = s.original_max_position_embeddings or max_positions

    def correction_dim(rotations: float) -> float:
        return (d * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(fast), correction_dim(slow)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001  # no division by zero (transformers' rule)
    pos_freqs = theta ** (torch.arange(0, d, 2).to(dtype=torch.float) / d)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, attention


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
             max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2] fp32, attention factor) as transformers computes them."""
    if scaling is None:
        return _default_inv_freq(head_dim, theta), 1.0
    if scaling.rope_type == "llama3":
        return _llama3(_default_inv_freq(head_dim, theta), scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"rope_type {scaling.rope_type!r} is not supported; "
                     f"supported: {', '.join(ROPE_TYPES)}")
