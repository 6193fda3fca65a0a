"""Canonical names of a sharded model's parameters (what the reshard and the trainer see).

Contract:
- ``named_local_parameters(model)`` lists ``(canonical_name, local_tensor)`` for this rank's stage
  and TP slice, in a deterministic order. Canonical names are megatron-core's local-spec names with
  the *global* layer index (``decoder.layers.{offset(pp_rank) + L}...``), whatever the layer spec:
  TE's fused norm weights (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) are
  renamed ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight``. The tensors are the live
  parameters (no copy). The critic's head is ``output_layer.weight`` of shape [1, H].
- ``tp_partition_dim(param)``: the dim a parameter is split on across TP, or None if replicated.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridrl.models.build import ShardedModel

_TE_RENAMES = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def canonical_name(local_name: str, layer_offset: int) -> str:
    """Module parameter name -> canonical name (global layer index, local-spec norm names)."""
    match = _LAYER.match(local_name)
    if not match:
        return local_name
    layer, rest = int(match.group(1)), match.group(2)
    for te_name, local in _TE_RENAMES:
        if rest == te_name:
            rest = local
    return f"decoder.layers.{layer + layer_offset}.{rest}"


def named_local_parameters(model: ShardedModel) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, live local parameter) of this rank's stage and TP slice."""
    return [
        (canonical_name(name, model.layer_offset), param)
        for name, param in model.module.named_parameters()
    ]


def tp_partition_dim(param: torch.Tensor) -> int | None:
    """Dim along which megatron splits ``param`` over TP (None: replicated on every TP rank)."""
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim)
    return None
