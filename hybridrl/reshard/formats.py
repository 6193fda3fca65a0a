"""Weight formats the reshard delivers: each a local permutation of a canonical gen piece.

Contract (a format is ``fmt(spec, piece) -> [(name, tensor)]``, piece = canonical rows of the
rank's gen shard, see hybridrl.reshard.specs):
- ``megatron_format(gen, rank)``: megatron-core GPTModel tensors of the gen layout, stage-local
  layer names, vocab chunks padded with zero rows to ``gen.vocab_chunk``. With a megatron gen
  placement (``vocab_pad=None``) that is the TRAINING model's padded vocab split tg ways, not the
  padding of a GPTModel built at tp = tg (V=32000, t=8, tg=1: 32768 rows, not 32000).
- ``engine_format(shape, gen, rank)``: the per-TP-rank format shared by SGLang and the builtin
  engine: HF-style names with global layer indices, ``self_attn.qkv_proj.weight`` = [q; k; v] of
  the rank's heads (and ``qkv_proj.bias`` likewise for Qwen2), ``mlp.gate_up_proj.weight`` =
  [gate; up] of the rank's slice, ``o_proj``, ``down_proj``, Qwen3's per-head
  ``self_attn.q_norm.weight`` / ``self_attn.k_norm.weight`` [hd] (replicated, as SGLang's
  ``Qwen3Attention.q_norm`` / ``k_norm``), vocab-parallel ``embed_tokens`` / ``lm_head`` padded to ``gen.vocab_chunk`` (build
  ``gen`` with the engine's ``vocab_pad``, SGLang: 64). Tied models send ``lm_head`` only as the
  last stage's copy (pp > 1). ValueError when gen TP cannot split the KV heads.
- Qwen3-MoE: the router is ``model.layers.L.mlp.gate.weight`` [E, H] (replicated) and expert
  e's tensors ``model.layers.L.mlp.experts.e.gate_up_proj.weight`` = [gate; up] of the rank's
  slice of its F and ``...experts.e.down_proj.weight`` (each expert's F cut over gen tp).
- ``hf_format(shape)``: full HF tensors for export (q_proj, k_proj, v_proj, gate_proj, up_proj,
  down_proj, o_proj, norms, embed_tokens, lm_head unless tied; a MoE layer's ``mlp.gate`` and
  ``mlp.experts.e.{gate_proj,up_proj,down_proj}``: the per-expert names checkpoints hold on
  disk); needs full pieces (gen tp = 1).
- ``build_format(name, shape, gen, rank)`` picks one by name (``FORMATS``).
- ``hf_to_canonical(shape, hf)``: the inverse of ``hf_format`` (full canonical tensors by key).
"""

from __future__ import annotations

import torch

from hybridrl.reshard.assemble import Format
from hybridrl.reshard.placement import Placement
from hybridrl.reshard.specs import (
    EMBED,
    FINAL_NORM,
    OUTPUT,
    LlamaShape,
    ParamSpec,
    build_specs,
    to_storage,
)

_LAYER_NAMES = {  # megatron suffix -> HF suffix (engine packing for qkv / fc1)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attn.qkv_proj.weight",
    "self_attention.linear_qkv.bias": "self_attn.qkv_proj.bias",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # Qwen3 [hd], replicated
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",  # Qwen3-MoE router [E, H], replicated
}
_EXPERT_NAMES = {"linear_fc1.weight": "gate_up_proj.weight", "linear_fc2.weight": "down_proj.weight"}


def hf_name(spec: ParamSpec) -> str:
    """HF / engine name of a megatron parameter (qkv -> qkv_proj, fc1 -> gate_up_proj)."""
    if spec.layer is None:
        return {EMBED: "model.embed_tokens.weight", FINAL_NORM: "model.norm.weight",
                OUTPUT: "lm_head.weight"}[spec.name]
    suffix = spec.name.split(f"layers.{spec.layer}.", 1)[1]
    if spec.expert is not None:  # mlp.experts.local_experts.e.linear_fc1.weight (e global)
        last = (suffix.split(f"local_experts.{spec.expert}.", 1)[1] if "local_experts." in suffix
                else suffix.split("experts.", 1)[1].removesuffix(str(spec.expert)))  # TE
        return f"model.layers.{spec.layer}.mlp.experts.{spec.expert}.{_EXPERT_NAMES[last]}"
    return f"model.layers.{spec.layer}.{_LAYER_NAMES[suffix]}"


def split_qkv(shape: LlamaShape, piece: torch.Tensor):
    """Canonical qkv rows of whole groups [Gr*(hpg+2)*hd, *R] (R = [H] weight, [] bias)
    -> q [Gr*hpg*hd, *R], k [Gr*hd, *R], v [Gr*hd, *R]."""
    hpg, hd, rest = shape.heads_per_group, shape.head_dim, tuple(piece.shape[1:])
    g = piece.view(-1, hpg + 2, hd, *rest)  # [Gr, hpg+2, hd, *R]
    q = g[:, :hpg].reshape(-1, *rest)
    return q, g[:, hpg].reshape(-1, *rest), g[:, hpg + 1].reshape(-1, *rest)


def megatron_format(gen: Placement, rank: int) -> Format:
    """Gen-layout megatron tensors with stage-local names, vocab chunks zero-padded to
    ``gen.vocab_chunk`` (module doc)."""

    def fmt(spec: ParamSpec, piece: torch.Tensor):
        name = spec.local_name(gen.pp, gen.num_layers)
        return [(name, to_storage(spec, piece, gen.vocab_chunk).contiguous())]

    return fmt


def check_engine_split(shape: LlamaShape, tp: int) -> None:
    if shape.num_query_groups % tp:
        raise ValueError(
            f"gen tp={tp} cannot split num_key_value_heads={shape.num_query_groups}: the engine "
            f"format needs num_key_value_heads % tp == 0 (choose gen tp dividing "
            f"{shape.num_query_groups})"
        )


def engine_format(shape: LlamaShape, gen: Placement, rank: int) -> Format:
    """The per-TP-rank format of SGLang and the builtin engine for ``rank`` of ``gen``: HF
    names, global layer indices, ``qkv_proj`` = [q; k; v] and ``gate_up_proj`` = [gate; up] of
    the rank's slice, vocab chunks padded to ``gen.vocab_chunk`` (module doc). ValueError when
    gen tp does not divide the KV heads."""
    check_engine_split(shape, gen.tp)

    def fmt(spec: ParamSpec, piece: torch.Tensor):
        name = hf_name(spec)
        if spec.kind == "qkv":
            return [(name, torch.cat(split_qkv(shape, piece)))]  # [q; k; v]
        if spec.kind == "fc1":
            return [(name, piece.reshape(-1, piece.shape[-1]).contiguous())]  # [gate; up]
        return [(name, to_storage(spec, piece, gen.vocab_chunk).contiguous())]

    return fmt


def hf_format(shape: LlamaShape) -> Format:
    """Full HF tensors (q/k/v_proj, gate/up_proj, ...; no lm_head when tied) for export; each
    piece must be the whole tensor (a gen placement with tp = pp = 1), else ValueError."""

    def fmt(spec: ParamSpec, piece: torch.Tensor):
        if piece.shape[spec.cut_dim] != spec.rows:
            raise ValueError(f"hf_format needs full tensors; {spec.name} has "
                             f"{piece.shape[spec.cut_dim]} of {spec.rows} rows (use gen tp=1)")
        if spec.tied_copy:
            return []
        name = hf_name(spec)
        if spec.kind == "qkv":
            base, _, what = name.rsplit(".", 2)  # what: weight | bias
            q, k, v = split_qkv(shape, piece)
            return [(f"{base}.q_proj.{what}", q), (f"{base}.k_proj.{what}", k),
                    (f"{base}.v_proj.{what}", v)]
        if spec.kind == "fc1":
            base = name.rsplit(".", 2)[0]
            return [(f"{base}.gate_proj.weight", piece[0].contiguous()),
                    (f"{base}.up_proj.weight", piece[1].contiguous())]
        return [(name, piece.contiguous())]

    return fmt


def hf_to_canonical(shape: LlamaShape, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full canonical tensors by key from full HF tensors (inverse of ``hf_format``)."""
    out = {}
    hpg, hd = shape.heads_per_group, shape.head_dim
    for spec in build_specs(shape):
        if spec.tied_copy:
            continue
        name = hf_name(spec)
        base, what = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]  # what: weight | bias
        if spec.kind == "qkv":
            rest = spec.shape[1:]  # (H,) weight, () bias
            q = hf[f"{base}.q_proj.{what}"].view(-1, hpg, hd, *rest)  # [G, hpg, hd, *R]
            k = hf[f"{base}.k_proj.{what}"].view(-1, 1, hd, *rest)
            v = hf[f"{base}.v_proj.{what}"].view(-1, 1, hd, *rest)
            out[spec.key] = torch.cat([q, k, v], dim=1).reshape(spec.shape)
        elif spec.kind == "fc1":
            out[spec.key] = torch.stack([hf[f"{base}.gate_proj.weight"], hf[f"{base}.up_proj.weight"]])
        else:
            out[spec.key] = hf[name]
    return out


FORMATS = ("megatron", "engine", "hf")


def build_format(name: str, shape: LlamaShape, gen: Placement, rank: int):
    """The format called ``name`` (one of FORMATS) for ``rank`` of the gen placement."""
    if name == "megatron":
        return megatron_format(gen, rank)
    if name == "engine":
        return engine_format(shape, gen, rank)
    if name == "hf":
        return hf_format(shape)
    raise ValueError(f"format must be one of {FORMATS}, got {name!r}")
