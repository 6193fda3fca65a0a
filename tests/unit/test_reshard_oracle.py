"""Independent oracle for the reshard: shards cut straight from full HF tensors, no library code.

The helpers build megatron TP shards and engine (SGLang-style) shards from HF tensors with their
own slicing, so the library's canonical views and format conversions are checked against code
that shares nothing with them. The tests below check the library's single-process conversions
(train shard -> canonical -> megatron / engine / HF) against this oracle; the distributed tests
import the same helpers.
"""

import torch

from hybridrl.reshard.specs import LlamaShape, build_specs

SMALL = LlamaShape(hidden=32, ffn=48, heads=16, num_query_groups=8, layers=8, vocab=100,
                   head_dim=4, make_vocab_size_divisible_by=8)
PAD = 999.0  # training padding rows hold this; it must never reach a destination


def balanced(t, p, d):
    """Layer matrices only, every piece divisible by d: Table 2 holds exactly. (shape, specs)"""
    shape = LlamaShape(hidden=4, ffn=t * d, heads=t, num_query_groups=t, layers=p, vocab=8,
                       head_dim=d, make_vocab_size_divisible_by=1)
    return shape, [s for s in build_specs(shape) if s.kind in ("qkv", "fc1", "row")]


def make_hf(shape: LlamaShape, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Seeded full HF llama tensors."""
    g = torch.Generator().manual_seed(seed)
    H, F, hd = shape.hidden, shape.ffn, shape.head_dim
    qd, kd = shape.heads * hd, shape.num_query_groups * hd

    def r(*s):
        return torch.randn(*s, generator=g).to(dtype)

    hf = {"model.embed_tokens.weight": r(shape.vocab, H), "model.norm.weight": r(H)}
    if not shape.tied:
        hf["lm_head.weight"] = r(shape.vocab, H)
    for L in range(shape.layers):
        p = f"model.layers.{L}."
        hf.update({
            p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
            p + "self_attn.q_proj.weight": r(qd, H), p + "self_attn.k_proj.weight": r(kd, H),
            p + "self_attn.v_proj.weight": r(kd, H), p + "self_attn.o_proj.weight": r(H, qd),
            p + "mlp.gate_proj.weight": r(F, H), p + "mlp.up_proj.weight": r(F, H),
            p + "mlp.down_proj.weight": r(H, F),
        })
        if shape.qkv_bias:
            hf.update({p + "self_attn.q_proj.bias": r(qd), p + "self_attn.k_proj.bias": r(kd),
                       p + "self_attn.v_proj.bias": r(kd)})
    return hf


def _vocab(full, n, b, chunk, pad_value):
    out = torch.full((chunk, full.shape[1]), pad_value, dtype=full.dtype)
    lo, hi = min(b * chunk, full.shape[0]), min((b + 1) * chunk, full.shape[0])
    out[: hi - lo] = full[lo:hi]
    return out


def megatron_shards(shape, hf, n, b, pp, a, chunk, pad_value=0.0, naming="local"):
    """Megatron tensors (stage-local names) of TP rank b of n on stage a of pp, from HF."""
    hpg, hd, G = shape.heads_per_group, shape.head_dim, shape.num_query_groups
    per_stage = shape.layers // pp
    out = {}
    if a == 0:
        out["embedding.word_embeddings.weight"] = _vocab(
            hf["model.embed_tokens.weight"], n, b, chunk, pad_value)
    if a == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not shape.tied or pp > 1:
            head = hf["model.embed_tokens.weight" if shape.tied else "lm_head.weight"]
            out["output_layer.weight"] = _vocab(head, n, b, chunk, pad_value)
    ln1 = "self_attention.linear_qkv.layer_norm_weight" if naming == "te" else "input_layernorm.weight"
    ln2 = "mlp.linear_fc1.layer_norm_weight" if naming == "te" else "pre_mlp_layernorm.weight"
    for local in range(per_stage):
        L = a * per_stage + local
        h, m = f"model.layers.{L}.", f"decoder.layers.{local}."

        def interleave(what, h=h):
            q, k, v = (hf[h + f"self_attn.{x}_proj.{what}"] for x in "qkv")
            groups = []
            for grp in range(b * G // n, (b + 1) * G // n):
                groups += [q[grp * hpg * hd:(grp + 1) * hpg * hd], k[grp * hd:(grp + 1) * hd],
                           v[grp * hd:(grp + 1) * hd]]
            return torch.cat(groups)

        if shape.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = interleave("bias")
        f = shape.ffn // n
        cols = shape.heads * hd // n
        out.update({
            m + ln1: hf[h + "input_layernorm.weight"].clone(),
            m + ln2: hf[h + "post_attention_layernorm.weight"].clone(),
            m + "self_attention.linear_qkv.weight": interleave("weight"),
            m + "self_attention.linear_proj.weight": hf[h + "self_attn.o_proj.weight"][:, b * cols:(b + 1) * cols].clone(),
            m + "mlp.linear_fc1.weight": torch.cat([hf[h + "mlp.gate_proj.weight"][b * f:(b + 1) * f],
                                                    hf[h + "mlp.up_proj.weight"][b * f:(b + 1) * f]]),
            m + "mlp.linear_fc2.weight": hf[h + "mlp.down_proj.weight"][:, b * f:(b + 1) * f].clone(),
        })
    return out


def engine_shards(shape, hf, n, b, pp, a, chunk):
    """SGLang-style tensors (global layer names) of gen TP rank b of n on stage a of pp."""
    hd = shape.head_dim
    per_stage = shape.layers // pp
    out = {}
    if a == 0:
        out["model.embed_tokens.weight"] = _vocab(hf["model.embed_tokens.weight"], n, b, chunk, 0.0)
    if a == pp - 1:
        out["model.norm.weight"] = hf["model.norm.weight"]
        if not shape.tied or pp > 1:
            head = hf["model.embed_tokens.weight" if shape.tied else "lm_head.weight"]
            out["lm_head.weight"] = _vocab(head, n, b, chunk, 0.0)
    qn, kn, f = shape.heads * hd // n, shape.num_query_groups * hd // n, shape.ffn // n
    for L in range(a * per_stage, (a + 1) * per_stage):
        h = f"model.layers.{L}."
        if shape.qkv_bias:
            out[h + "self_attn.qkv_proj.bias"] = torch.cat([
                hf[h + "self_attn.q_proj.bias"][b * qn:(b + 1) * qn],
                hf[h + "self_attn.k_proj.bias"][b * kn:(b + 1) * kn],
                hf[h + "self_attn.v_proj.bias"][b * kn:(b + 1) * kn]])
        out.update({
            h + "input_layernorm.weight": hf[h + "input_layernorm.weight"],
            h + "post_attention_layernorm.weight": hf[h + "post_attention_layernorm.weight"],
            h + "self_attn.qkv_proj.weight": torch.cat([
                hf[h + "self_attn.q_proj.weight"][b * qn:(b + 1) * qn],
                hf[h + "self_attn.k_proj.weight"][b * kn:(b + 1) * kn],
                hf[h + "self_attn.v_proj.weight"][b * kn:(b + 1) * kn]]),
            h + "self_attn.o_proj.weight": hf[h + "self_attn.o_proj.weight"][:, b * qn:(b + 1) * qn],
            h + "mlp.gate_up_proj.weight": torch.cat([hf[h + "mlp.gate_proj.weight"][b * f:(b + 1) * f],
                                                      hf[h + "mlp.up_proj.weight"][b * f:(b + 1) * f]]),
            h + "mlp.down_proj.weight": hf[h + "mlp.down_proj.weight"][:, b * f:(b + 1) * f],
        })
    return out


def mismatches(got: dict, want: dict) -> list[str]:
    """Names missing, extra, or not bit-identical."""
    bad = sorted(set(got) ^ set(want))
    for k in set(got) & set(want):
        if got[k].shape != want[k].shape or not torch.equal(got[k], want[k]):
            bad.append(k)
    return bad
