"""Llama-family model description, its validation against a layout, and megatron's config.

Contract:
- ``LlamaSpec`` is the frozen, device-free description of a llama-family decoder (RMSNorm, RoPE,
  SwiGLU, GQA, tied or untied embeddings, optional q/k/v bias as in Qwen2, optional per-head
  q/k RMSNorm as in Qwen3, ``head_dim`` independent of hidden/heads, RoPE scaling ``llama3`` or
  ``yarn``: ``hybridrl.models.rope``).
- ``LlamaSpec.from_hf_config(dict)`` / ``read_hf_spec(folder)`` read an HF config.json
  (``LlamaForCausalLM`` incl. Llama 3.x, ``Qwen2ForCausalLM`` incl. Qwen2.5, ``Qwen3ForCausalLM``,
  ``Qwen3MoeForCausalLM``) and reject anything else with one ``ValueError`` naming the key
  (other architectures, other MoE variants: ``hybridrl.config.hf_model``,
  sliding-window attention in use, other RoPE types, attention biases on Llama/Qwen3, MLP biases,
  activations other than SiLU); ``to_hf_config()`` writes it back. ``from_model_config`` takes
  hybridrl's builtin ``ModelConfig`` sizes.
- MoE (``num_experts`` > 0, Qwen3-MoE): every layer's MLP is ``num_experts`` routed SwiGLU
  experts of width ``moe_ffn_hidden_size``, top-``moe_topk`` softmax routing, the top-k weights
  renormalized when ``moe_norm_topk_prob`` (Qwen3's ``norm_topk_prob``), no shared expert;
  ``moe_aux_loss_coef`` > 0 adds megatron's switch load-balancing loss (HF:
  ``router_aux_loss_coef``, used only when ``output_router_logits``). A dense spec
  (``num_experts`` 0) is exactly the spec of before.
- ``check_layout(spec, train)`` raises before any weight is read when heads, query groups, FFN
  size, layers or experts (``num_experts`` by ep, ``moe_ffn_hidden_size`` by etp) do not divide
  as the layout needs, or when experts meet ep > 1 on a dense model.
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
    MOE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    RopeScaling,
    check_hf_features,
    hf_architecture,
    moe_num_experts,
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
    num_experts: int = 0  # 0 = dense; Qwen3-MoE: num_experts
    moe_topk: int = 0  # num_experts_per_tok
    moe_ffn_hidden_size: int | None = None  # moe_intermediate_size
    moe_norm_topk_prob: bool = True  # norm_topk_prob
    moe_aux_loss_coef: float = 0.0  # router_aux_loss_coef when output_router_logits, else 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

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
        if (self.architecture in MOE_ARCHITECTURES) != self.is_moe:
            raise ValueError(f"architecture {self.architecture!r} with num_experts="
                             f"{self.num_experts}: MoE architectures ({', '.join(MOE_ARCHITECTURES)}"
                             ") need num_experts >= 1, dense ones 0")
        if self.is_moe:
            if self.moe_ffn_hidden_size is None:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
            if not 1 <= self.moe_topk <= self.num_experts:
                raise ValueError(f"model moe_topk (num_experts_per_tok)={self.moe_topk} must be "
                                 f"in 1..num_experts={self.num_experts}")
            if not isinstance(self.moe_ffn_hidden_size, int) or self.moe_ffn_hidden_size < 1:
                raise ValueError("model moe_ffn_hidden_size (moe_intermediate_size) must be a "
                                 f"positive integer, got {self.moe_ffn_hidden_size!r}")
            if self.moe_aux_loss_coef < 0:
                raise ValueError(f"model moe_aux_loss_coef={self.moe_aux_loss_coef} must be >= 0")
        elif self.moe_topk or self.moe_ffn_hidden_size is not None or self.moe_aux_loss_coef:
            raise ValueError("model moe_topk / moe_ffn_hidden_size / moe_aux_loss_coef need "
                             "num_experts >= 1 (a MoE model)")

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
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            rope_scaling=parse_rope_scaling(cfg),
            **_moe_fields(cfg, arch),
        )

    @classmethod
    def from_model_config(cls, mc) -> LlamaSpec:
        """The builtin llama of hybridrl's ``ModelConfig`` (sizes from its fields); with
        ``num_experts`` > 0 the builtin Qwen3-MoE (q/k norm, routed experts)."""
        experts = getattr(mc, "num_experts", 0)
        moe = dict(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=experts,
                   moe_topk=mc.moe_topk, moe_ffn_hidden_size=mc.moe_ffn_hidden_size or None,
                   moe_norm_topk_prob=mc.moe_norm_topk_prob,
                   moe_aux_loss_coef=mc.moe_aux_loss_coef) if experts else {}
        return cls(
            hidden_size=mc.hidden_size, num_layers=mc.num_layers,
            num_attention_heads=mc.num_attention_heads, num_query_groups=mc.num_query_groups,
            ffn_hidden_size=mc.ffn_hidden_size, vocab_size=mc.vocab_size,
            max_position_embeddings=mc.max_position_embeddings, rope_theta=mc.rope_theta,
            norm_eps=mc.norm_eps, tie_word_embeddings=mc.tie_word_embeddings, **moe)

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
            if model_type in ("qwen3", "qwen3_moe"):
                cfg.update(use_sliding_window=False)
        if self.is_moe:
            cfg.update(num_experts=self.num_experts, num_experts_per_tok=self.moe_topk,
                       moe_intermediate_size=self.moe_ffn_hidden_size,
                       norm_topk_prob=self.moe_norm_topk_prob,
                       router_aux_loss_coef=self.moe_aux_loss_coef,
                       output_router_logits=self.moe_aux_loss_coef > 0,
                       decoder_sparse_step=1, mlp_only_layers=[])
        return cfg


def _moe_fields(cfg: dict, arch: str) -> dict:
    """LlamaSpec's MoE fields of a validated config.json (empty for dense architectures)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    aux = float(cfg.get("router_aux_loss_coef") or 0.0)
    return dict(num_experts=moe_num_experts(cfg)[1], moe_topk=cfg["num_experts_per_tok"],
                moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_aux_loss_coef=aux if cfg.get("output_router_logits") else 0.0)


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
    if spec.is_moe:
        checks += (("num_experts", spec.num_experts, "ep", train.ep),
                   ("moe_ffn_hidden_size (moe_intermediate_size)", spec.moe_ffn_hidden_size,
                    "etp", train.etp))
    elif train.ep > 1 or train.etp != train.tp:
        raise ValueError(f"parallel ep={train.ep} / etp={train.etp} need a MoE model; this one "
                         "is dense (use ep 1 and etp = tp)")
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
    if spec.is_moe:
        kwargs.update(moe_kwargs(spec, train, on_cuda))
    if spec.rope_scaling is not None:  # yarn: transformers scales cos and sin by the factor
        from hybridrl.models.rope import inv_freq

        _, factor = inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                             spec.max_position_embeddings)
        if factor != 1.0:  # q and k both rotated: the logits scale by factor**2
            kwargs["softmax_scale"] = factor * factor / math.sqrt(spec.head_dim)
    kwargs.update(overrides)
    if spec.is_moe and train.tp > 1 and not kwargs.get("sequence_parallel"):
        raise ValueError(f"a MoE model at tp={train.tp} needs model.sequence_parallel: true "
                         "(megatron-core trains MoE layers under TP only with sequence "
                         "parallelism)")
    return TransformerConfig(**kwargs)


def moe_kwargs(spec: LlamaSpec, train, on_cuda: bool = False) -> dict:
    """megatron-core TransformerConfig fields of a Qwen3-MoE layer: dropless top-k softmax
    routing (top-k of the logits, then softmax over the k = Qwen3's renormalized weights when
    ``moe_norm_topk_prob``; softmax over all experts, then top-k, otherwise), the alltoall token
    dispatcher over ep, SequentialMLP experts (grouped GEMM only with CUDA), no shared expert,
    megatron's switch aux loss when ``moe_aux_loss_coef`` > 0."""
    if spec.moe_topk == 1 and spec.moe_norm_topk_prob:
        raise ValueError("num_experts_per_tok=1 with norm_topk_prob=true is not supported "
                         "(megatron needs the softmax before a top-1 selection)")
    aux = spec.moe_aux_loss_coef
    return dict(
        num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_pre_softmax=not spec.moe_norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
        moe_expert_capacity_factor=None,
        expert_model_parallel_size=train.ep, expert_tensor_parallel_size=train.etp,
    )
