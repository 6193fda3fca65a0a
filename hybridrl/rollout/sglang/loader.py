"""A weight loader for SGLang's ``update_weights_from_tensor`` that also takes per-expert shards.

Contract:
- ``load_direct(model, named_tensors)``: SGLang calls it as a custom loader (server argument
  ``custom_weight_loader=[LOADER]``, request ``load_format=LOADER``) with one gen-TP rank's
  engine-format tensors (``hybridrl.reshard.formats.engine_format``). Every name the model has
  is copied as SGLang's ``direct`` loader copies it (whole parameter, shapes must match). A
  mixture-of-experts expert shard ``model.layers.L.mlp.experts.e.gate_up_proj.weight``
  [2Fm/tp, H] = [gate; up] of the rank's F slice is copied into expert e's slot of the layer's
  FusedMoE ``w13_weight`` [E, 2Fm/tp, H] (gate rows first, as SGLang's w1 / w3 shards lie), and
  ``...experts.e.down_proj.weight`` [H, Fm/tp] into ``w2_weight[e]``: SGLang's Qwen3-MoE at
  ep 1 cuts every expert's F over its TP ranks exactly as the engine format does, so each
  expert arrives in its own bucket and nothing is gathered or stacked.
- An unknown name or a wrong shape raises ValueError naming it (the push checks the table
  ``sglang.layout.engine_param_shapes`` first, so this is a last guard).
- The engine a MoE model starts with (``hybridrl.rollout.sglang.adapter``):
  ``start_kwargs(engine_kwargs)`` are the ServerArgs keywords that make SGLang load through
  ``LOADER`` and keep the layout it writes: ``custom_weight_loader`` = the user's list (from
  ``rollout.engine_kwargs``) plus ``LOADER`` (SGLang's ``WeightUpdater`` runs a
  ``load_format`` only if it is in that list, then imports it by its dotted path), and
  ``moe_runner_backend="triton"`` (its FusedMoE keeps the checkpoint layout [gate; up] per
  expert after loading; ``auto`` picks flashinfer_trtllm for Qwen3-MoE on SM100, whose
  post-load re-layout a hot copy would bypass; so would SGLang's opt-in
  ``SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED=1``, off by default and not supported here).
  ``engine_kwargs_problem(engine_kwargs)``: one line when ``rollout.engine_kwargs`` changes
  that layout (``FIXED``: expert or MoE data parallelism inside the engine, another MoE
  runner), else None.
"""

from __future__ import annotations

import re

import torch

LOADER = "hybridrl.rollout.sglang.loader.load_direct"
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.weight$")
_FUSED = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}
FIXED = {"ep_size": 1, "moe_dp_size": 1, "moe_runner_backend": "triton"}  # the layout written


def _target(params: dict, name: str) -> torch.Tensor:
    if name in params:
        return params[name].data
    m = _EXPERT.match(name)
    if m is None or f"{m.group(1)}.{_FUSED[m.group(3)]}" not in params:
        raise ValueError(f"SGLang model has no parameter {name!r}")
    return params[f"{m.group(1)}.{_FUSED[m.group(3)]}"].data[int(m.group(2))]


@torch.no_grad()
def load_direct(model, named_tensors) -> None:
    """Copy each (name, tensor) into ``model`` (see the module docstring)."""
    params = dict(model.named_parameters())
    for name, tensor in named_tensors:
        target = _target(params, name)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"SGLang parameter {name!r} has shape {tuple(target.shape)}, "
                             f"got {tuple(tensor.shape)}")
        target.copy_(tensor)


def engine_kwargs_problem(engine_kwargs: dict) -> str | None:
    """One line when ``rollout.engine_kwargs`` changes the layout the loader writes, else None."""
    for key, value in FIXED.items():
        if key in engine_kwargs and engine_kwargs[key] != value:
            return (f"rollout.engine_kwargs sets {key}={engine_kwargs[key]!r}: a mixture-of-"
                    f"experts model is pushed into SGLang's FusedMoE at {key}={value!r} "
                    "(every expert on every TP rank, its F cut over tp)")
    return None


def start_kwargs(engine_kwargs: dict) -> dict:
    """The ServerArgs keywords a MoE engine starts with (see the module docstring)."""
    loaders = list(engine_kwargs.get("custom_weight_loader") or [])
    return {"moe_runner_backend": FIXED["moe_runner_backend"],
            "custom_weight_loader": loaders + [LOADER] * (LOADER not in loaders)}
