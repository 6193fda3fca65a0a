"""The parameters one SGLang TP rank of a Llama / Qwen2 model has: names and per-rank shapes.

Contract: ``engine_param_shapes(shape, tp, vocab_pad=64) -> {name: shape}`` lists what
``dict(model.named_parameters())`` holds on every TP rank of SGLang's ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` (gen pp = 1), derived from the HF sizes the way SGLang's layers split them
(tests/unit/test_sglang_contract.py checks this against the pinned release's source):
- ``qkv_proj`` (QKVParallelLinear): rows (heads/tp + 2*kv_heads/tp) * head_dim, cols hidden;
  its bias (Qwen2, ``shape.qkv_bias``) likewise. kv_heads % tp != 0 is refused (ValueError), as
  the engine format refuses it (SGLang would replicate KV heads instead).
- ``gate_up_proj`` (MergedColumnParallelLinear): [2*ffn/tp, hidden]; ``down_proj`` and
  ``o_proj`` (RowParallelLinear): [hidden, ffn/tp] and [hidden, heads*head_dim/tp].
- ``embed_tokens`` / ``lm_head`` (VocabParallelEmbedding / ParallelLMHead): the vocab padded to
  a multiple of ``vocab_pad`` (SGLang's DEFAULT_VOCAB_PADDING_SIZE, 64), split tp ways; a tied
  model has no ``lm_head.weight`` (SGLang reuses ``embed_tokens``).
- norms [hidden], replicated; Qwen3 (``shape.qk_norm``) adds ``self_attn.q_norm`` /
  ``k_norm`` [head_dim], replicated (SGLang's ``Qwen3Attention``).
Mixture of experts (``shape.num_experts``; SGLang's Qwen3-MoE at ep 1): SGLang's FusedMoE keeps
a layer's experts as one [E, 2Fm/tp, H] ``w13_weight`` and one [E, H, Fm/tp] ``w2_weight`` per
rank (every expert's F cut over tp), which ``load_format="direct"`` cannot fill expert by
expert, so the adapter pushes a MoE model through ``hybridrl.rollout.sglang.loader`` and the
table lists what that loader takes: the engine format's router ``mlp.gate.weight`` [E, H] and
per-expert ``mlp.experts.e.gate_up_proj.weight`` [2Fm/tp, H] / ``down_proj`` [H, Fm/tp]
(moe_intermediate_size % tp != 0 is refused, ValueError).
``check_named_tensors(named, table, dtype)`` returns the first problem (unknown name, wrong
shape or dtype) as one line, or None: the push checks every tensor with it before sending.

GPU order: SGLang puts TP rank k of an engine on GPU ``base_gpu_id + k * gpu_id_step``, so a
gen-TP group's ranks, in gen-TP order, must ascend at a constant stride within one node
(``sglang_order_problem``). ``sglang_gen_placement(train, shape, gen, node_size)`` keeps ``gen``
when it does (HybridFlow, vanilla and consecutive groupings do whenever gen tp | train tp);
otherwise (e.g. the placement-optimal grouping of gen tp > train tp: train tp 4 pp 2 -> gen tp
8 gives [0, 4, 1, 5, 2, 6, 3, 7]) it picks, among the placeable layouts (``gen``'s groups in
ascending order, every strided split {base + k * step}), the one that keeps the most elements
in place (``assignment.kept_matrix``), and raises one ValueError line when none is placeable.
"""

from __future__ import annotations

import torch

from hybridrl.reshard.placement import ENGINE_VOCAB_PAD, Placement
from hybridrl.reshard.specs import LlamaShape


def _split(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"gen tp={tp} must divide {what}={total} for SGLang's per-rank layout")
    return total // tp


def engine_param_shapes(shape: LlamaShape, tp: int,
                        vocab_pad: int = ENGINE_VOCAB_PAD) -> dict[str, tuple[int, ...]]:
    """{name: per-rank shape} of one SGLang TP rank (see the module docstring)."""
    H, hd = shape.hidden, shape.head_dim
    heads = _split(shape.heads, tp, "num_attention_heads")
    kv = _split(shape.num_query_groups, tp, "num_key_value_heads")
    ffn = None if shape.num_experts else _split(shape.ffn, tp, "intermediate_size")
    vocab = _split(-(-shape.vocab // vocab_pad) * vocab_pad, tp, "padded vocab")
    qkv_rows = (heads + 2 * kv) * hd
    table: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, H),
                                         "model.norm.weight": (H,)}
    if not shape.tied:
        table["lm_head.weight"] = (vocab, H)
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        table[p + "input_layernorm.weight"] = (H,)
        table[p + "post_attention_layernorm.weight"] = (H,)
        table[p + "self_attn.qkv_proj.weight"] = (qkv_rows, H)
        if shape.qkv_bias:
            table[p + "self_attn.qkv_proj.bias"] = (qkv_rows,)
        if shape.qk_norm:  # Qwen3Attention.q_norm / k_norm: RMSNorm(head_dim), replicated
            table[p + "self_attn.q_norm.weight"] = (hd,)
            table[p + "self_attn.k_norm.weight"] = (hd,)
        table[p + "self_attn.o_proj.weight"] = (H, heads * hd)
        if shape.num_experts:  # the engine format's per-expert shards (sglang/loader.py)
            fm = _split(shape.moe_ffn_hidden_size, tp, "moe_intermediate_size")
            table[p + "mlp.gate.weight"] = (shape.num_experts, H)
            for e in range(shape.num_experts):
                table[f"{p}mlp.experts.{e}.gate_up_proj.weight"] = (2 * fm, H)
                table[f"{p}mlp.experts.{e}.down_proj.weight"] = (H, fm)
            continue
        table[p + "mlp.gate_up_proj.weight"] = (2 * ffn, H)
        table[p + "mlp.down_proj.weight"] = (H, ffn)
    return table


def check_named_tensors(named, table: dict[str, tuple[int, ...]],
                        dtype: torch.dtype) -> str | None:
    """First problem of ``named`` ([(name, tensor)]) against the engine's table, or None."""
    for name, tensor in named:
        if name not in table:
            return f"tensor {name!r} is not a parameter of the SGLang model"
        if tuple(tensor.shape) != table[name]:
            return (f"tensor {name!r} has shape {tuple(tensor.shape)}, the SGLang model's "
                    f"is {table[name]}")
        if tensor.dtype != dtype:
            return f"tensor {name!r} is {tensor.dtype}, the engine runs {dtype}"
    return None


# ------------------------------------------------------------------ gen-TP groups in GPU order


def gen_tp_groups(gen: Placement) -> list[list[int]]:
    """The ranks of every gen replica in gen-TP order (gen pp = 1)."""
    n = gen.world // (gen.tp * gen.pp)
    return [[gen.rank_at(b, 0, rep) for b in range(gen.tp)] for rep in range(n)]


def sglang_order_problem(gen: Placement, node_size: int | None = None) -> str | None:
    """None when SGLang can place every gen-TP group: its ranks, in gen-TP order, ascend at a
    constant stride (TP rank k runs on GPU base + k * step) inside one node of ``node_size``
    consecutive ranks; else the first group that cannot be placed, as one line."""
    for members in gen_tp_groups(gen):
        step = members[1] - members[0] if len(members) > 1 else 1
        if step < 1 or any(b - a != step for a, b in zip(members, members[1:])):
            return f"gen-TP group {members} is not ascending at a constant stride"
        if node_size and members[0] // node_size != members[-1] // node_size:
            return f"gen-TP group {members} spans nodes of {node_size} ranks"
    return None


def _from_groups(gen: Placement, groups: list[list[int]], label: str) -> Placement:
    coords: list = [None] * gen.world
    for rep, members in enumerate(groups):
        for b, r in enumerate(members):
            coords[r] = (b, 0, rep)
    return Placement(gen.tp, 1, gen.num_layers, gen.vocab_chunk, tuple(coords), label)


def _strided(gen: Placement) -> list[list[list[int]]]:
    """Every split of the ranks into groups {base + k * step}, blocks of tp * step ranks."""
    out, tg = [], gen.tp
    for step in range(1, gen.world // tg + 1):
        if gen.world % (tg * step) == 0:
            out.append([[base + k * step for k in range(tg)]
                        for block in range(0, gen.world, tg * step)
                        for base in range(block, block + step)])
    return out


def sglang_gen_placement(train: Placement, shape: LlamaShape, gen: Placement,
                         node_size: int | None = None) -> Placement:
    """``gen`` itself when SGLang can place its gen-TP groups; else, of the SGLang-placeable
    layouts (``gen``'s groups with members ascending, the ``consecutive``-like strided splits),
    the one whose ranks keep the most of what they hold (the fewest bytes moved). ValueError
    (one line) when none fits, or gen pp != 1."""
    from hybridrl.reshard.assignment import kept_matrix
    from hybridrl.reshard.specs import build_specs

    if gen.pp != 1:
        raise ValueError(f"SGLang engines run gen pp = 1 here; got gen pp {gen.pp}")
    first = sglang_order_problem(gen, node_size)
    if first is None:
        return gen
    kept = kept_matrix(train, build_specs(shape), gen.tp, 1, gen.vocab_chunk)
    candidates = [_from_groups(gen, [sorted(m) for m in gen_tp_groups(gen)],
                               f"{gen.grouping}_sglang_order")]
    candidates += [_from_groups(gen, groups, "strided") for groups in _strided(gen)]
    fits = [c for c in candidates if sglang_order_problem(c, node_size) is None]
    if not fits:
        raise ValueError(f"no generation layout of gen tp {gen.tp} fits SGLang's GPU order "
                         f"(base_gpu_id + k * gpu_id_step within one node): {first}")

    def score(p: Placement) -> int:
        return sum(kept[tb + train.tp * ta][p.coords[r][0]]
                   for r, (tb, ta, _) in enumerate(train.coords))

    return max(fits, key=score)  # the first of equal scores
