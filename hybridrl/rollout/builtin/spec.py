"""The sizes of the llama decoder the builtin engine runs (``EngineSpec``), full model, before TP.

Contract: ``EngineSpec`` is frozen and checks its MoE fields (``moe_topk`` in [1, num_experts],
a positive ``moe_ffn_hidden_size``, fewer than 2**15 experts: the routing record is int16);
``EngineSpec.from_llama(spec, vocab_chunk, max_seq_len)`` builds it from
``hybridrl.models.spec.LlamaSpec``. Re-exported by ``hybridrl.rollout.builtin.engine``.
"""

from __future__ import annotations

import dataclasses

from hybridrl.config.hf_model import RopeScaling


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Sizes of the llama decoder the engine runs (full model, before TP)."""

    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int  # real vocabulary (ids >= vocab_size are never sampled)
    vocab_chunk: int  # rows of embed/lm_head per TP rank (the engine's padded vocab / tp)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_seq_len: int = 2048
    qkv_bias: bool = False  # Qwen2: biases on the q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE
    rope_scaling: RopeScaling | None = None  # llama3 / yarn (hybridrl.models.rope)
    max_position_embeddings: int | None = None  # the config's (yarn's default context)
    num_experts: int = 0  # Qwen3-MoE: experts per layer (0 = dense MLP)
    moe_topk: int = 0  # experts each token uses
    moe_ffn_hidden_size: int | None = None  # each expert's F (HF moe_intermediate_size)
    moe_norm_topk_prob: bool = True  # renormalize the top-k probabilities to sum 1

    def __post_init__(self) -> None:
        if self.num_experts:
            if not 1 <= self.moe_topk <= self.num_experts:
                raise ValueError(f"moe_topk must be in [1, num_experts={self.num_experts}], "
                                 f"got {self.moe_topk!r}")
            if not isinstance(self.moe_ffn_hidden_size, int) or self.moe_ffn_hidden_size < 1:
                raise ValueError(f"moe_ffn_hidden_size must be a positive integer with experts, "
                                 f"got {self.moe_ffn_hidden_size!r}")
            if self.num_experts >= 1 << 15:  # the routing record is int16
                raise ValueError(f"num_experts={self.num_experts} must be below 32768")

    @classmethod
    def from_llama(cls, spec, vocab_chunk: int, max_seq_len: int | None = None) -> EngineSpec:
        """From ``hybridrl.models.spec.LlamaSpec``; ``vocab_chunk`` from the gen placement."""
        return cls(spec.hidden_size, spec.ffn_hidden_size, spec.num_attention_heads,
                   spec.num_query_groups, spec.head_dim, spec.num_layers, spec.vocab_size,
                   vocab_chunk, spec.rope_theta, spec.norm_eps, spec.tie_word_embeddings,
                   max_seq_len or spec.max_position_embeddings,
                   bool(getattr(spec, "qkv_bias", False)), bool(getattr(spec, "qk_norm", False)),
                   getattr(spec, "rope_scaling", None), spec.max_position_embeddings,
                   int(getattr(spec, "num_experts", 0) or 0), int(getattr(spec, "moe_topk", 0) or 0),
                   getattr(spec, "moe_ffn_hidden_size", None),
                   bool(getattr(spec, "moe_norm_topk_prob", True)))
