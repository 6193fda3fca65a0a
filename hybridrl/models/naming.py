"""Canonical names of a sharded model's parameters (what the reshard and the trainer see).

Contract:
- ``named_local_parameters(model)`` lists ``(canonical_name, local_tensor)`` for this rank's stage
  and TP slice, in a deterministic order. Canonical names are megatron-core's local-spec names with
  the *global* layer index (``decoder.layers.{offset(pp_rank) + L}...``), whatever the layer spec:
  TE's fused norm weights (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) are
  renamed ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight``. The tensors are the live
  parameters (no copy). The critic's head is ``output_layer.weight`` of shape [1, H].
  MoE experts carry the *global* expert index too: this rank's local expert j (megatron's
  ``mlp.experts.local_experts.{j}``) is ``mlp.experts.local_experts.{ep_rank * E/ep + j}``;
  the router is ``mlp.router.weight`` [E, H] (replicated over tp and ep).
- ``expert_index(name)``: the global expert of a canonical expert parameter (None otherwise).
- ``tp_partition_dim(param)``: the dim a parameter is split on across TP (expert linears: across
  expert TP), or None if replicated.
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
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_GLOBAL_EXPERT = re.compile(r"^decoder\.layers\.\d+\.mlp\.experts\.local_experts\.(\d+)\.")


def canonical_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """Module parameter name -> canonical name (global layer and expert index, local-spec norm
    names)."""
    match = _LAYER.match(local_name)
    if not match:
        return local_name
    layer, rest = int(match.group(1)), match.group(2)
    for te_name, local in _TE_RENAMES:
        if rest == te_name:
            rest = local
    expert = _EXPERT.match(rest)
    if expert:
        rest = f"mlp.experts.local_experts.{int(expert.group(1)) + expert_offset}.{expert.group(2)}"
    return f"decoder.layers.{layer + layer_offset}.{rest}"


def expert_index(name: str) -> int | None:
    """Global expert index of a canonical expert parameter name; None for every other name."""
    match = _GLOBAL_EXPERT.match(name)
    return int(match.group(1)) if match else None


def expert_offset(model: ShardedModel) -> int:
    """Global index of this rank's first local expert (ep_rank * num_experts / ep)."""
    experts = getattr(model.spec, "num_experts", 0)
    if not experts:
        return 0
    return model.groups.ep_rank * (experts // model.groups.ep_size)


def named_local_parameters(model: ShardedModel) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, live local parameter) of this rank's stage, TP slice and experts."""
    offset = expert_offset(model)
    return [
        (canonical_name(name, model.layer_offset, offset), param)
        for name, param in model.module.named_parameters()
    ]


def tp_partition_dim(param: torch.Tensor) -> int | None:
    """Dim along which megatron splits ``param`` over TP (None: replicated on every TP rank)."""
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim)
    return None
