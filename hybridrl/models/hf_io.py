"""HF checkpoint IO: local Llama/Qwen2/Qwen3 folders <-> sharded megatron-core models.

Contract:
- ``build_from_hf(folder, groups, role)`` reads and validates ``folder/config.json`` and the layout
  (unsupported architecture, heads / query groups / FFN / layers not divisible: one ValueError)
  *before* any weight is read, builds the model and loads it.
- ``build_from_config(model_cfg, groups, role, path=...)``: hybridrl's ``ModelConfig`` -> model
  (an HF folder when one is given, else the builtin llama of the config's sizes).
- ``load_hf_weights(model, folder)``: every rank reads only the rows/columns of its own shard with
  safetensors' ``safe_open(...).get_slice`` (never a whole tensor it does not own). Vocab rows past
  ``spec.vocab_size`` (megatron's padding) are zero. A critic loads the trunk and, when the folder
  has one, ``score.weight`` (HF's token-classification head); otherwise its head keeps its init.
  A reward model must have ``score.weight`` (ValueError otherwise).
- Qwen3-MoE: the router ``mlp.router.weight`` is HF's ``mlp.gate.weight``; global expert e's
  ``linear_fc1`` is [gate_proj; up_proj] rows of its expert-TP slice, ``linear_fc2`` the
  ``down_proj`` columns (``model.layers.L.mlp.experts.e.*`` on disk, what transformers writes).
- ``export_hf(model, folder)``: TP pieces are gathered on the dp_rank 0 replica (experts: expert
  TP pieces on the expert-dp 0 ranks, then over ep); the tp_rank 0 rank of each stage writes ``model-000{s+1}-of-000{pp}.safetensors``; global rank 0 writes config.json
  and ``model.safetensors.index.json``. Vocab padding never reaches the files; tied models write no
  ``lm_head.weight``; every tensor is written in the model's dtype. Collective: every rank of
  the layout must call it.
- The slicing math is pure given a reader: ``local_slice_from_hf`` (HF -> this rank's shard) and
  ``hf_tensors_from_full`` (every TP piece -> HF tensors) are inverse; see docs/models.md.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hybridrl.models.build import VALUE_ROLES, ShardedModel, build_model
from hybridrl.models.naming import expert_index, named_local_parameters, tp_partition_dim
from hybridrl.models.spec import DTYPES, check_layout, read_hf_spec

if TYPE_CHECKING:
    from hybridrl.parallel.groups import ParallelGroups

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LAYER_MAP = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # Qwen3, [head_dim]
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_REPLICATED = ("input_layernorm.weight", "pre_mlp_layernorm.weight",
               "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
               "mlp.router.weight")
_LAYER_MAP["mlp.router.weight"] = "mlp.gate.weight"  # Qwen3-MoE router, [E, H]
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


class HFReader:
    """Lazily opened safetensors files of one HF folder; reads row/column ranges only."""

    def __init__(self, folder: str | Path, stack: contextlib.ExitStack):
        from safetensors import safe_open

        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model path {str(folder)!r} has no *.safetensors files")
        self._handles, self._where = {}, {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            self._handles[path.name] = handle
            for key in handle.keys():
                self._where[key] = path.name

    def has(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str):
        if name not in self._where:
            raise KeyError(f"{name!r} is not in the safetensors files of {str(self.folder)!r}")
        return self._handles[self._where[name]].get_slice(name)

    def full(self, name: str) -> torch.Tensor:
        return self._slice(name)[:]

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self._slice(name)[lo:hi]

    def cols(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self._slice(name)[:, lo:hi]


def _vocab_rows(reader, name, model: ShardedModel) -> torch.Tensor:
    """This TP rank's rows [start, start + V/tp) of a vocab matrix, zero past spec.vocab_size."""
    v_local = model.padded_vocab_size // model.groups.tp_size
    lo = model.vocab_start
    hi = min(lo + v_local, model.spec.vocab_size)
    out = torch.zeros(v_local, model.spec.hidden_size)
    if hi > lo:
        out[: hi - lo] = reader.rows(name, lo, hi).float()
    return out


def _qkv_local(reader, prefix: str, kind: str, model: ShardedModel) -> torch.Tensor:
    """Megatron's fused rows: for each local query group g: [q_g (hpg*hd); k_g (hd); v_g (hd)]."""
    spec, tp_size, tp_rank = model.spec, model.groups.tp_size, model.groups.tp_rank
    groups_local = spec.num_query_groups // tp_size
    hd, q_rows = spec.head_dim, spec.heads_per_group * spec.head_dim
    g0, g1 = tp_rank * groups_local, (tp_rank + 1) * groups_local
    q = reader.rows(f"{prefix}.q_proj.{kind}", g0 * q_rows, g1 * q_rows)
    k = reader.rows(f"{prefix}.k_proj.{kind}", g0 * hd, g1 * hd)
    v = reader.rows(f"{prefix}.v_proj.{kind}", g0 * hd, g1 * hd)
    rest = q.shape[1:]
    fused = torch.cat([t.reshape(groups_local, -1, *rest) for t in (q, k, v)], dim=1)
    return fused.reshape(-1, *rest)


def _expert_local(reader, prefix: str, expert: int, kind: str, model: ShardedModel):
    """This rank's expert-TP slice of global expert ``expert`` (HF: per-expert gate/up/down)."""
    etp, etp_rank = model.groups.etp_size, model.groups.etp_rank
    f = model.spec.moe_ffn_hidden_size // etp
    lo, hi = etp_rank * f, (etp_rank + 1) * f
    base = f"{prefix}.mlp.experts.{expert}"
    if kind == "linear_fc2":
        return reader.cols(f"{base}.down_proj.weight", lo, hi)
    return torch.cat([reader.rows(f"{base}.gate_proj.weight", lo, hi),
                      reader.rows(f"{base}.up_proj.weight", lo, hi)])


def _layer_local(reader, layer: int, rest: str, model: ShardedModel) -> torch.Tensor:
    prefix = f"model.layers.{layer}"
    tp_size, tp_rank = model.groups.tp_size, model.groups.tp_rank
    spec = model.spec
    expert = _EXPERT.match(rest)
    if expert:
        return _expert_local(reader, prefix, int(expert.group(1)), expert.group(2), model)
    if rest in _REPLICATED:
        return reader.full(f"{prefix}.{_LAYER_MAP[rest]}")
    if rest.startswith("self_attention.linear_qkv."):
        return _qkv_local(reader, f"{prefix}.self_attn", rest.rsplit(".", 1)[1], model)
    if rest in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        width = (spec.num_attention_heads * spec.head_dim if "proj" in rest
                 else spec.ffn_hidden_size) // tp_size
        return reader.cols(f"{prefix}.{_LAYER_MAP[rest]}", tp_rank * width, (tp_rank + 1) * width)
    if rest == "mlp.linear_fc1.weight":
        f = spec.ffn_hidden_size // tp_size
        gate = reader.rows(f"{prefix}.mlp.gate_proj.weight", tp_rank * f, (tp_rank + 1) * f)
        up = reader.rows(f"{prefix}.mlp.up_proj.weight", tp_rank * f, (tp_rank + 1) * f)
        return torch.cat([gate, up])
    raise ValueError(f"no HF mapping for megatron parameter decoder.layers.{layer}.{rest}")


def local_slice_from_hf(reader, name: str, model: ShardedModel) -> torch.Tensor | None:
    """The local shard of canonical parameter ``name`` read from HF (None: keep as is)."""
    match = _LAYER.match(name)
    if match:
        return _layer_local(reader, int(match.group(1)), match.group(2), model)
    if name == "embedding.word_embeddings.weight":
        return _vocab_rows(reader, "model.embed_tokens.weight", model)
    if name == "decoder.final_layernorm.weight":
        return reader.full("model.norm.weight")
    if name == "output_layer.weight" and model.role in VALUE_ROLES:
        if reader.has("score.weight"):
            return reader.full("score.weight")
        if model.role == "reward":
            raise ValueError("a reward model folder needs score.weight (an HF "
                             "*ForTokenClassification head with num_labels=1); this one has none")
        return None
    if name == "output_layer.weight":
        tied = model.spec.tie_word_embeddings
        if not tied and not reader.has("lm_head.weight"):
            raise ValueError("config.json says tie_word_embeddings=false but the checkpoint has "
                             "no lm_head.weight")
        return _vocab_rows(reader, "model.embed_tokens.weight" if tied else "lm_head.weight",
                           model)
    raise ValueError(f"no HF mapping for megatron parameter {name}")


def load_hf_weights(model: ShardedModel, folder: str | Path) -> None:
    """Copy this rank's slices of the HF checkpoint in ``folder`` into ``model``."""
    spec = read_hf_spec(folder)
    if spec != model.spec:
        raise ValueError(f"config.json of {str(folder)!r} describes {spec}, but the model was "
                         f"built for {model.spec}")
    with contextlib.ExitStack() as stack, torch.no_grad():
        reader = HFReader(folder, stack)
        for name, param in named_local_parameters(model):
            local = local_slice_from_hf(reader, name, model)
            if local is None:
                continue
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(f"{name}: HF slice has shape {tuple(local.shape)}, the "
                                 f"parameter {tuple(param.shape)}")
            param.copy_(local.to(param.dtype))


def build_from_hf(folder: str | Path, groups: ParallelGroups, role: str = "actor",
                  **kwargs: Any) -> ShardedModel:
    """Validate config.json and the layout, then build ``role`` and load the weights
    (``kwargs``: ``hybridrl.models.build.build_model``'s options: dtype, seed, recompute...)."""
    spec = read_hf_spec(folder)
    check_layout(spec, groups.train)
    model = build_model(spec, groups, role, **kwargs)
    load_hf_weights(model, folder)
    return model


def build_from_config(model_cfg, groups, role: str = "actor", *, path: str = "",
                      seed: int = 1, **build_options) -> ShardedModel:
    """``role`` from hybridrl's ``ModelConfig``: an HF folder (``path`` or ``model_cfg.path``),
    else the builtin llama of its sizes, initialized from ``seed`` (the same seed gives the
    same trunk to the actor, critic and reference). The activation-memory knobs
    (``hybridrl.models.activation``) are checked before any weight is read."""
    from hybridrl.models.activation import activation_overrides
    from hybridrl.models.build import transformer_engine_available
    from hybridrl.models.spec import LlamaSpec

    folder = path or model_cfg.path
    spec = read_hf_spec(folder) if folder else LlamaSpec.from_model_config(model_cfg)
    overrides = activation_overrides(model_cfg, groups.tp_size, groups.pp_size, spec.num_layers,
                                     transformer_engine_available())
    if folder:
        return build_from_hf(folder, groups, role, dtype=model_cfg.dtype, seed=seed,
                             **overrides, **build_options)
    return build_model(spec, groups, role, dtype=model_cfg.dtype, seed=seed, **overrides,
                       **build_options)


def hf_tensors_from_full(name: str, pieces: list[torch.Tensor], spec, role: str = "actor"):
    """HF tensors of canonical parameter ``name`` from its per-TP-rank pieces (pure)."""
    match = _LAYER.match(name)
    if not match:
        if name == "embedding.word_embeddings.weight":
            return {"model.embed_tokens.weight": torch.cat(pieces)[: spec.vocab_size]}
        if name == "decoder.final_layernorm.weight":
            return {"model.norm.weight": pieces[0]}
        if name == "output_layer.weight" and role in VALUE_ROLES:
            return {"score.weight": pieces[0]}
        if name == "output_layer.weight":
            return {} if spec.tie_word_embeddings else {
                "lm_head.weight": torch.cat(pieces)[: spec.vocab_size]}
        raise ValueError(f"no HF mapping for megatron parameter {name}")
    prefix, rest = f"model.layers.{match.group(1)}", match.group(2)
    expert = _EXPERT.match(rest)
    if expert:  # pieces: the expert-TP slices of one global expert
        base = f"{prefix}.mlp.experts.{expert.group(1)}"
        if expert.group(2) == "linear_fc2":
            return {f"{base}.down_proj.weight": torch.cat(pieces, dim=1)}
        halves = [p.chunk(2) for p in pieces]
        return {f"{base}.gate_proj.weight": torch.cat([h[0] for h in halves]),
                f"{base}.up_proj.weight": torch.cat([h[1] for h in halves])}
    if rest in _REPLICATED:
        return {f"{prefix}.{_LAYER_MAP[rest]}": pieces[0]}
    if rest in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return {f"{prefix}.{_LAYER_MAP[rest]}": torch.cat(pieces, dim=1)}
    if rest == "mlp.linear_fc1.weight":
        halves = [p.chunk(2) for p in pieces]
        return {f"{prefix}.mlp.gate_proj.weight": torch.cat([h[0] for h in halves]),
                f"{prefix}.mlp.up_proj.weight": torch.cat([h[1] for h in halves])}
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        full = torch.cat(pieces)
        per_group = full.reshape(spec.num_query_groups, -1, *full.shape[1:])
        q_rows = spec.heads_per_group * spec.head_dim
        q, k, v = per_group.split([q_rows, spec.head_dim, spec.head_dim], dim=1)
        return {f"{prefix}.self_attn.{n}_proj.{kind}": t.reshape(-1, *full.shape[1:])
                for n, t in (("q", q), ("k", k), ("v", v))}
    raise ValueError(f"no HF mapping for megatron parameter {name}")


def _gather_tp(param: torch.Tensor, groups, name: str = "tp") -> list[torch.Tensor]:
    """Every TP rank's piece of ``param`` (one all_gather over the ``name`` group, TP or expert
    TP, when split)."""
    local = param.detach().contiguous()
    size = groups.size(name)
    if tp_partition_dim(param) is None or size == 1:
        return [local]
    pieces = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(pieces, local, group=groups.groups[name])
    return pieces


def _expert_tensors(model: ShardedModel) -> dict[str, torch.Tensor]:
    """HF tensors of every expert of this stage, on the stage's writer (expert coordinates all
    0; {} elsewhere): expert-TP pieces gathered on the expert-dp index 0 ranks, then each ep
    rank's experts collected over the ep group. Collective over the ranks holding experts."""
    groups = model.groups
    if not getattr(model.spec, "num_experts", 0) or groups.index("expt_dp") != 0:
        return {}
    mine: dict[str, torch.Tensor] = {}
    for name, param in named_local_parameters(model):
        if expert_index(name) is None:
            continue
        pieces = [p.cpu() for p in _gather_tp(param, groups, "expt_tp")]
        if groups.etp_rank == 0:
            mine.update(hf_tensors_from_full(name, pieces, model.spec, model.role))
    if groups.etp_rank != 0:
        return {}
    seen: list = [None] * groups.ep_size
    dist.all_gather_object(seen, mine, group=groups.ep)
    if groups.ep_rank != 0:
        return {}
    return {k: v for part in seen for k, v in part.items()}


def export_hf(model: ShardedModel, folder: str | Path) -> None:
    """Write the sharded model as an HF folder (config.json + safetensors + index)."""
    from safetensors.torch import save_file

    groups, folder = model.groups, Path(folder)
    tensors: dict[str, torch.Tensor] = {}
    experts = _expert_tensors(model)
    if groups.dp_rank == 0:
        for name, param in named_local_parameters(model):
            if expert_index(name) is not None:
                continue
            pieces = [p.cpu() for p in _gather_tp(param, groups)]
            if groups.tp_rank == 0:
                for hf_name, t in hf_tensors_from_full(name, pieces, model.spec, model.role).items():
                    tensors[hf_name] = t.to(DTYPES[model.dtype]).contiguous()
    file_name = f"model-{groups.pp_rank + 1:05d}-of-{groups.pp_size:05d}.safetensors"
    writer = groups.dp_rank == 0 and groups.tp_rank == 0
    if writer:  # the stage's first rank: also expert rank (0, 0, 0) of the stage
        tensors.update({k: t.to(DTYPES[model.dtype]).contiguous() for k, t in experts.items()})
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
    mine = ({k: file_name for k in tensors}, sum(t.numel() * t.element_size()
                                                 for t in tensors.values())) if writer else ({}, 0)
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    if dist.get_rank() == 0:
        weight_map = {k: v for part, _ in seen for k, v in part.items()}
        index = {"metadata": {"total_size": sum(size for _, size in seen)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        hf_config = model.spec.to_hf_config(model.dtype)
        if model.role in VALUE_ROLES:
            hf_config.update(architectures=[hf_config["architectures"][0].replace(
                "ForCausalLM", "ForTokenClassification")], num_labels=1)
        (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    dist.barrier()
