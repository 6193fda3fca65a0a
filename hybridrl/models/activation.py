"""Activation-memory knobs of the training models, turned into megatron TransformerConfig fields.

Contract:
- ``activation_overrides(model_cfg, tp_size, pp_size, num_layers, use_te)`` returns the
  ``TransformerConfig`` overrides for hybridrl's ``model.*`` knobs, after checking that megatron
  can honour them on this spec and device (a ``ValueError`` naming the key and the reason, raised
  before any weight is read):
  * ``recompute_granularity``: ``none`` | ``selective`` (megatron's core-attention recompute) |
    ``full`` (whole layers, ``recompute_method`` ``uniform``: chunks of ``recompute_num_layers``
    layers; ``block``: the first ``recompute_num_layers`` layers of each stage);
  * ``sequence_parallel``: activations outside TP regions split over the TP group along the
    sequence; needs tp > 1; on the local spec (the CPU path) its norms carry megatron's
    ``sequence_parallel`` attribute (hybridrl.models.local_fused.SequenceParallelNorm);
  * fusions (RoPE, bias-activation, masked softmax, persistent layer norm, gradient-accumulation
    fusion) are on exactly when the TE spec is used (GPU), off on the local spec;
  * ``deallocate_pipeline_outputs`` is always on: a stage frees the data of the activations it
    has sent to the next stage (megatron keeps only their autograd metadata).
- The knobs change memory and time, never the numbers: losses and gradients equal those without
  them (tests/distributed/test_activation_memory.py).
"""

from __future__ import annotations


def check_activation_knobs(model_cfg, tp_size: int, pp_size: int, num_layers: int,
                           use_te: bool) -> None:
    """Raise ``ValueError`` when megatron cannot honour a knob on this layout/spec."""
    if model_cfg.sequence_parallel and tp_size == 1:
        raise ValueError("model.sequence_parallel needs parallel.tp > 1 (it splits the sequence "
                         "over the tensor-parallel group); got tp=1")
    per_stage = num_layers // pp_size
    if (model_cfg.recompute_granularity == "full"
            and not 1 <= model_cfg.recompute_num_layers <= per_stage):
        raise ValueError(f"model.recompute_num_layers must be in [1, {per_stage}] (layers per "
                         f"pipeline stage); got {model_cfg.recompute_num_layers}")


def activation_overrides(model_cfg, tp_size: int, pp_size: int, num_layers: int,
                         use_te: bool) -> dict:
    """megatron ``TransformerConfig`` overrides for the knobs (see the module docstring)."""
    check_activation_knobs(model_cfg, tp_size, pp_size, num_layers, use_te)
    out = {"deallocate_pipeline_outputs": True, "sequence_parallel": model_cfg.sequence_parallel}
    granularity = model_cfg.recompute_granularity
    if granularity == "full":
        out.update(recompute_granularity="full", recompute_method=model_cfg.recompute_method,
                   recompute_num_layers=model_cfg.recompute_num_layers)
    elif granularity == "selective":
        out.update(recompute_granularity="selective")
    if use_te:
        out.update(apply_rope_fusion=True, bias_activation_fusion=True,
                   masked_softmax_fusion=True, persist_layer_norm=True,
                   gradient_accumulation_fusion=True)
    return out
