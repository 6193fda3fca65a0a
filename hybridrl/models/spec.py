"""Llama-family model description, its validation against a layout, and megatron's config.

Contract:
- ``LlamaSpec`` is the frozen, device-free description of a llama-family decoder (RMSNorm, RoPE,
  SwiGLU, GQA, tied or untied embeddings, optional q/k/v bias as in Qwen2, optional per-head
  q/k RMSNorm as in Qwen3, ``head_dim`` independent of hidden/heads, RoPE scaling ``llama3`` or
  ``yarn``: ``hybridrl.models.rope``).
- ``LlamaSpec.from_hf_config(dict)`` / ``read_hf_spec(folder)`` read an HF config.json
  (``LlamaForCausalLM`` incl. Llama 3.x, ``Qwen2ForCausalLM`` incl. Qwen2.5, ``Qwen3ForCausalLM``)
  and reject anything else with one ``ValueError`` naming the key (other architectures incl. MoE,
  sliding-window attention in use, other RoPE types, attention biases on Llama/Qwen3, MLP biases,
  activations other than SiLU); ``to_hf_config()`` writes it back. ``from_model_config`` takes
  hybridrl's builtin ``ModelConfig`` sizes.
- ``check_layout(spec, train)`` raises before any weight is read when heads, query groups, FFN
  size or layers do not divide as the layout needs.
- ``padded_vocab_size`` is megatron's rule: round up to ``make_vocab_size_divisible_by * tp``.
- ``to_transformer_config(spec, train, dtype)`` is the megatron-core ``TransformerConfig`` that
  hybridrl builds every model of this spec with.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from hybridrl.config.hf_model import (
    MODEL_TYPES,
    SUPPORTED_ARCHITECTURES,
    RopeScaling,
    check_hf_features,
    hf_architecture,
    parse_rope_scaling,
)

VOCAB_DIVISIBLE_BY = 128  # megatron's make_vocab_size_divisible_by default
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class LlamaSpec:
    """Sizes and options of one llama-family decoder (HF naming in comments)."""

    hidden_size: int
    num_layers: int  # num_hidden_layers
    num_attention_heads: int
    num_query_groups: int  # num_key_value_heads
    ffn_hidden_size: int  # intermediate_size
    vocab_size: int  # unpadded
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5  # rms_norm_eps
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    qkv_bias: bool = False  # Qwen2
    architecture: str = "LlamaForCausalLM"
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of every query and key head
    rope_scaling: RopeScaling | None = None  # None: plain RoPE

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_query_groups (num_key_value_heads)={self.num_query_groups}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlamaSpec:
        """Validate an HF config.json dict and describe it; raises ValueError on anything else."""
        arch = hf_architecture(cfg)
        check_hf_features(cfg, arch)
        rope = cfg.get("rope_parameters") or {}
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads,
            ffn_hidden_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            qkv_bias=arch == "Qwen2ForCausalLM",
            architecture=arch,
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=parse_rope_scaling(cfg),
        )

    @classmethod
    def from_model_config(cls, mc) -> LlamaSpec:
        """The builtin llama of hybridrl's ``ModelConfig`` (sizes from its fields)."""
        return cls(
            hidden_size=mc.hidden_size, num_layers=mc.num_layers,
            num_attention_heads=mc.num_attention_heads, num_query_groups=mc.num_query_groups,
            ffn_hidden_size=mc.ffn_hidden_size, vocab_size=mc.vocab_size,
            max_position_embeddings=mc.max_position_embeddings, rope_theta=mc.rope_theta,
            norm_eps=mc.norm_eps, tie_word_embeddings=mc.tie_word_embeddings)

    def to_hf_config(self, dtype: str = "fp32") -> dict:
        """An HF config.json dict that transformers loads into the same model."""
        model_type = MODEL_TYPES[self.architecture]
        cfg = {
            "architectures": [self.architecture], "model_type": model_type,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups, "head_dim": self.head_dim,
            "intermediate_size": self.ffn_hidden_size, "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_eps, "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "torch_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
        }
        if self.rope_scaling is None:
            cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        else:  # transformers 4.x reads rope_scaling, 5.x converts it to rope_parameters
            cfg["rope_scaling"] = self.rope_scaling.to_hf()
        if model_type == "qwen2":
            cfg.update(use_sliding_window=False)
        else:
            cfg.update(attention_bias=False, mlp_bias=False)
            if model_type == "qwen3":
                cfg.update(use_sliding_window=False)
        return cfg


def read_hf_spec(folder: str | Path) -> LlamaSpec:
    """Read and validate ``folder/config.json`` (no weight is touched)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"model path {str(folder)!r} has no config.json")
    return LlamaSpec.from_hf_config(json.loads(path.read_text()))


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron's padding: the smallest multiple of ``divisible_by * tp_size`` >= vocab_size."""
    multiple = divisible_by * tp_size
    return math.ceil(vocab_size / multiple) * multiple


def check_layout(spec: LlamaSpec, train) -> None:
    """Raise ValueError (field and numbers) if ``spec`` cannot be split as ``train`` needs."""
    tp, pp = train.tp, train.pp
    checks = (
        ("num_attention_heads", spec.num_attention_heads, "tp", tp),
        ("num_query_groups (num_key_value_heads)", spec.num_query_groups, "tp", tp),
        ("ffn_hidden_size (intermediate_size)", spec.ffn_hidden_size, "tp", tp),
        ("num_layers (num_hidden_layers)", spec.num_layers, "pp", pp),
    )
    for field, value, axis, parts in checks:
        if value % parts:
            raise ValueError(f"model {field}={value} is not divisible by {axis}={parts}")
    padded = padded_vocab_size(spec.vocab_size, tp)
    if padded % tp:  # cannot happen with megatron's rule; kept as the documented invariant
        raise ValueError(f"padded vocab_size={padded} is not divisible by tp={tp}")


def to_transformer_config(spec: LlamaSpec, train, dtype: str = "fp32", **overrides):
    """megatron-core TransformerConfig for ``spec`` split as ``train`` (tp, pp)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_layout(spec, train)
    torch_dtype = DTYPES[dtype]
    on_cuda = torch.cuda.is_available()
    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=train.tp, pipeline_model_parallel_size=train.pp,
        params_dtype=torch_dtype, pipeline_dtype=torch_dtype,
        bf16=dtype == "bf16", fp16=dtype == "fp16",
        use_cpu_initialization=not on_cuda, perform_initialization=True,
        attention_softmax_in_fp32=True, apply_rope_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=False, qk_layernorm=spec.qk_norm,
    )
    if spec.rope_scaling is not None:  # yarn: transformers scales cos and sin by the factor
        from hybridrl.models.rope import inv_freq

        _, factor = inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                             spec.max_position_embeddings)
        if factor != 1.0:  # q and k both rotated: the logits scale by factor**2
            kwargs["softmax_scale"] = factor * factor / math.sqrt(spec.head_dim)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
