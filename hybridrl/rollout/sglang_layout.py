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
- norms [hidden], replicated.
``check_named_tensors(named, table, dtype)`` returns the first problem (unknown name, wrong
shape or dtype) as one line, or None: the push checks every tensor with it before sending.
"""

from __future__ import annotations

import torch

from hybridrl.reshard.placement import ENGINE_VOCAB_PAD
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
    ffn = _split(shape.ffn, tp, "intermediate_size")
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
        table[p + "self_attn.o_proj.weight"] = (H, heads * hd)
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
