"""FLOPs of a llama-family decoder's passes, by sequence length (pure; ``hybridrl plan --time``).

Contract (a multiply-add is 2 FLOPs; ``shape`` is a ``reshard.specs.LlamaShape``; h hidden, f
ffn, a = heads x head_dim, g = query groups x head_dim (GQA: K and V have g columns), V vocab):
- ``layer_matmul_flops(shape)``: one token through one layer's weight matrices:
  2 (h (a + 2g) + a h + 3 h f) (QKV, output projection, SwiGLU's three matrices).
- ``attention_flops(shape, length)``: one layer's scores and weighted sum for a whole causal
  sequence of ``length`` tokens: 2 x 2 x a x length (length + 1) / 2 (token i attends to i
  positions; GQA does not reduce it, every query head does its own dot products).
- ``head_flops(shape, role)``: the output per token: 2 h V for the actor / reference (logits),
  2 h for a critic's value head.
- ``forward_flops(shape, length, role)``: one sequence's forward (all layers, attention, head).
- ``train_flops(shape, length, role, recompute)``: forward + backward (2 x forward) and what the
  recompute granularity runs again (``full``: the layers' forward; ``selective``: the attention
  core); ``model_flops`` is the same without recompute (the numerator of MFU).
- ``shared_forward_flops(shape, prompt_len, length, rows, role)``: one sequence's share of a
  packed micro-batch whose ``rows`` sequences of one prompt compute the prompt (but its last
  token) once: forward_flops(length) less (1 - 1/rows) x forward_flops(prompt_len - 1) (the
  rest of each row, attention to the prompt's keys included, is its own);
  ``shared_tokens(prompt_len, length, rows)`` its tokens the same way. rows = 1: unshared.
- ``decode_token_flops(shape, context)``: one generated token at ``context`` tokens of KV.
- ``kv_bytes_per_token(shape, itemsize)``: K and V of all layers for one token.
- ``mean_sq``: E[L^2] of lengths uniform-ish around a mean is not known; callers pass the mean
  length (``hybridrl plan --time`` documents the resulting under-count of attention).
"""

from __future__ import annotations


def _dims(shape) -> tuple[int, int, int, int]:
    a = shape.heads * shape.head_dim
    g = shape.num_query_groups * shape.head_dim
    return shape.hidden, shape.ffn, a, g


def layer_matmul_flops(shape) -> float:
    """One token through one layer's weights (forward)."""
    h, f, a, g = _dims(shape)
    return 2.0 * (h * (a + 2 * g) + a * h + 3 * h * f)


def attention_flops(shape, length: float) -> float:
    """One layer's causal attention core for one sequence of ``length`` tokens (forward)."""
    _, _, a, _ = _dims(shape)
    return 4.0 * a * length * (length + 1) / 2


def head_flops(shape, role: str = "actor") -> float:
    """The output head per token: logits (actor, reference) or a value head (critic)."""
    return 2.0 * shape.hidden * (1 if role == "critic" else shape.vocab)


def forward_flops(shape, length: float, role: str = "actor") -> float:
    """One sequence's forward: every layer, its attention and the head."""
    layers = shape.layers * (layer_matmul_flops(shape) * length + attention_flops(shape, length))
    return layers + head_flops(shape, role) * length


def model_flops(shape, length: float, role: str = "actor") -> float:
    """Forward + backward of one sequence, no recompute (backward = 2 x forward)."""
    return 3.0 * forward_flops(shape, length, role)


def train_flops(shape, length: float, role: str = "actor", recompute: str = "none") -> float:
    """What a training pass computes, recomputation included."""
    extra = 0.0
    if recompute == "full":
        extra = forward_flops(shape, length, role) - head_flops(shape, role) * length
    elif recompute == "selective":
        extra = shape.layers * attention_flops(shape, length)
    return model_flops(shape, length, role) + extra


def shared_forward_flops(shape, prompt_len: float, length: float, rows: float,
                         role: str = "actor") -> float:
    """One sequence's forward when ``rows`` sequences of a micro-batch share its prompt."""
    saved = (1 - 1 / rows) * forward_flops(shape, max(prompt_len - 1, 0), role)
    return forward_flops(shape, length, role) - saved


def shared_tokens(prompt_len: float, length: float, rows: float) -> float:
    """One sequence's tokens when ``rows`` sequences of a micro-batch share its prompt."""
    return length - (1 - 1 / rows) * max(prompt_len - 1, 0)


def decode_token_flops(shape, context: float) -> float:
    """One generated token whose KV cache holds ``context`` tokens."""
    _, _, a, _ = _dims(shape)
    per_layer = layer_matmul_flops(shape) + 4.0 * a * context
    return shape.layers * per_layer + head_flops(shape)


def kv_bytes_per_token(shape, itemsize: int) -> float:
    """K and V of every layer for one token (GQA: g columns each)."""
    return 2.0 * shape.layers * shape.num_query_groups * shape.head_dim * itemsize
