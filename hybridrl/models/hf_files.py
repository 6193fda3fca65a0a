"""Check an HF model folder's safetensors files against its config.json, reading headers only.

Contract:
- ``expected_hf_shapes(spec, critic=False)`` (pure): HF name -> shape of every tensor a llama /
  Qwen2 / Qwen3 folder described by ``spec`` (``hybridrl.models.spec.LlamaSpec``) holds
  (``lm_head.weight`` only for an untied actor; a critic / reward model's head is not listed).
- ``safetensors_problems(folder, spec)`` reads the 8-byte length and the JSON header of each
  ``*.safetensors`` file (no tensor data) and returns one line per problem, naming the file
  and, for a shape, the tensor: a file shorter than its header says (truncated), a header
  that is not JSON, a tensor whose shape differs from config.json's. Tensors the model does
  not use (e.g. ``rotary_emb.inv_freq``) are ignored; missing tensors are the loader's to name.
  At most ``limit`` lines.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def expected_hf_shapes(spec, critic: bool = False) -> dict[str, tuple[int, ...]]:
    h, v, i, d = spec.hidden_size, spec.vocab_size, spec.ffn_hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h),
                                       "model.norm.weight": (h,)}
    if not critic and not spec.tie_word_embeddings:  # a critic's head is its loader's to check
        out["lm_head.weight"] = (v, h)
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
        if spec.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if spec.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return out


def _header(path: Path) -> tuple[dict | None, str | None]:
    """(header, None) or (None, the problem) of one safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None, f"'{path}' is truncated ({size} bytes: no safetensors header)"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return None, (f"'{path}' is truncated or not a safetensors file (header of "
                          f"{length} bytes, file of {size})")
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            return None, f"'{path}' has a corrupt safetensors header ({err})"
    if not isinstance(header, dict):
        return None, f"'{path}' has a corrupt safetensors header (not a JSON object)"
    end = max((max(t.get("data_offsets", [0, 0])) for k, t in header.items()
               if k != "__metadata__" and isinstance(t, dict)), default=0)
    if 8 + length + end > size:
        return None, (f"'{path}' is truncated ({size} bytes; its header describes "
                      f"{8 + length + end})")
    return header, None


def safetensors_problems(folder: str | Path, spec, critic: bool = False,
                         limit: int = 3) -> list[str]:
    """Problems of ``folder``'s safetensors files (see the module docstring)."""
    expected = expected_hf_shapes(spec, critic)
    problems: list[str] = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        header, problem = _header(path)
        if problem:
            problems.append(problem)
            continue
        for name, info in sorted(header.items()):
            want = expected.get(name)
            got = tuple(info.get("shape", ())) if isinstance(info, dict) else None
            if want is not None and got != want:
                problems.append(f"'{path}': tensor {name} has shape {list(got or ())}, "
                                f"config.json says {list(want)}")
    return problems[:limit]
