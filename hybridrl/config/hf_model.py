"""What hybridrl supports of an HF config.json, read without torch (models/ and reshard/ share it).

Contract:
- ``hf_architecture(cfg)``: the supported ``*ForCausalLM`` architecture of a config.json dict
  (``LlamaForCausalLM`` incl. Llama 3.x, ``Qwen2ForCausalLM`` incl. Qwen2.5, ``Qwen3ForCausalLM``;
  ``*ForTokenClassification`` maps to its trunk); ``model_type`` when ``architectures`` is absent.
  Anything else raises one ``ValueError`` naming ``architectures``.
- ``check_hf_features(cfg, arch)``: one ``ValueError`` naming the key for a feature these models
  do not have: an activation other than SiLU, MLP biases, sliding-window attention in use
  (``use_sliding_window`` true or a non-full ``layer_types`` entry), experts on a dense
  architecture (``num_experts``, ``num_local_experts``, ``n_routed_experts``), attention biases
  on Llama/Qwen3, another RoPE type or a partial rotary factor. ``Qwen3MoeForCausalLM``: every
  layer a MoE layer (``decoder_sparse_step`` 1, ``mlp_only_layers`` empty), no shared expert,
  ``num_experts`` >= 1 and 1 <= ``num_experts_per_tok`` <= ``num_experts``.
- ``RopeScaling`` is the frozen, validated description of a config's RoPE scaling: ``rope_type``
  ``"llama3"`` (Llama 3.1/3.2/3.3) or ``"yarn"`` (Qwen2.5's long-context recipe), with the keys
  each needs. No scaling (``rope_type`` ``"default"``) is ``None``. ``parse_rope_scaling(cfg)``
  reads ``rope_scaling`` (transformers 4.x; ``type`` is accepted for ``rope_type``) or
  ``rope_parameters`` (transformers 5). yarn follows transformers 5 (the installed oracle) and
  SGLang: ``factor`` as given (only a missing one is ``max_position_embeddings /
  original_max_position_embeddings``); transformers 4.4x-4.5x replaced ``factor`` by that ratio
  whenever ``original_max_position_embeddings`` was set, which builds another model.
  yarn's ``original_max_position_embeddings`` is None when the config has none (the RoPE then
  uses ``max_position_embeddings``, as transformers does). ``RopeScaling.to_hf()`` is the
  ``rope_scaling`` dict written back into an exported config.json: only keys the source had.
  The frequencies themselves are ``hybridrl.models.rope.inv_freq``.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM")
MODEL_TYPES = MappingProxyType({"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                                "Qwen3ForCausalLM": "qwen3",
                                "Qwen3MoeForCausalLM": "qwen3_moe"})  # read-only
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
ROPE_TYPES = ("default", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """One config's RoPE scaling (see the module docstring for the formulas)."""

    rope_type: str  # "llama3" | "yarn"
    factor: float
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3 (required), yarn (optional)
    beta_fast: float | None = None  # yarn; None = 32
    beta_slow: float | None = None  # yarn; None = 1
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn

    def to_hf(self) -> dict:
        """The ``rope_scaling`` dict of a config.json (keys that are set)."""
        out = {"rope_type": self.rope_type, "factor": self.factor}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in ("rope_type", "factor", "truncate") and value is not None:
                out[f.name] = value
        if self.rope_type == "yarn" and not self.truncate:
            out["truncate"] = False
        return out


def _number(params: dict, key: str, where: str, rope_type: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config.json {where}.{key}={value!r} is not supported: rope_type "
                         f"{rope_type!r} needs a number there")
    return float(value)


def parse_rope_scaling(cfg: dict) -> RopeScaling | None:
    """The validated RoPE scaling of an HF config.json dict (None: plain RoPE). Both
    ``rope_scaling`` and ``rope_parameters`` are read; two that disagree are refused."""
    partial = cfg.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json partial_rotary_factor={partial!r} is not supported: "
                         "only RoPE over the whole head (1.0)")
    found = {}
    for where in ("rope_scaling", "rope_parameters"):
        if cfg.get(where):
            found[where] = _parse_one(cfg, where)
    kinds = {s for s in found.values()}
    if len(kinds) > 1:
        raise ValueError(f"config.json rope_scaling and rope_parameters disagree: {found}")
    return kinds.pop() if kinds else None


def _parse_one(cfg: dict, where: str) -> RopeScaling | None:
    params = cfg[where]
    if not isinstance(params, dict):
        raise ValueError(f"config.json {where}={params!r} is not supported: expected an object")
    partial = params.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json {where}.partial_rotary_factor={partial!r} is not "
                         "supported: only RoPE over the whole head (1.0)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json {where}.rope_type={rope_type!r} is not supported; "
                         f"supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        low, high, factor = (_number(params, k, where, rope_type)
                             for k in ("low_freq_factor", "high_freq_factor", "factor"))
        original = _number(params, "original_max_position_embeddings", where, rope_type)
        if not high > low:
            raise ValueError(f"config.json {where}.high_freq_factor={high} must exceed "
                             f"low_freq_factor={low}")
        return RopeScaling("llama3", factor, low, high, int(original))
    # kept as written: a missing original context stays None (models/rope.py then uses
    # max_position_embeddings, as transformers does), so to_hf() never adds the key; transformers
    # 4.4x-4.5x would read an added original == max as factor = max / original = 1
    original = params.get("original_max_position_embeddings")
    context = original or cfg.get("max_position_embeddings")
    if params.get("factor") is None and context and cfg.get("max_position_embeddings"):
        factor = cfg["max_position_embeddings"] / context  # transformers 5's rule
    else:
        factor = _number(params, "factor", where, rope_type)
    opt = {k: (None if params.get(k) is None else _number(params, k, where, rope_type))
           for k in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")}
    return RopeScaling("yarn", factor, original_max_position_embeddings=(
        None if original is None else int(original)), truncate=bool(params.get("truncate", True)),
        **opt)


def hf_architecture(cfg: dict) -> str:
    """The supported ``*ForCausalLM`` architecture of a config.json (a token-classification
    head maps to its causal-LM trunk); ValueError naming ``architectures`` otherwise."""
    archs = cfg.get("architectures") or []
    by_type = {v: k for k, v in MODEL_TYPES.items()}
    arch = archs[0] if archs else by_type.get(cfg.get("model_type"))
    if isinstance(arch, str) and arch.endswith("ForTokenClassification"):  # a critic
        arch = arch.replace("ForTokenClassification", "ForCausalLM")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"config.json architectures={archs!r} (model_type="
                         f"{cfg.get('model_type')!r}) is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def check_hf_features(cfg: dict, arch: str) -> None:
    """One ValueError naming the key for a feature these models do not have."""
    _reject(cfg, "hidden_act", lambda v: v not in (None, "silu"), "only 'silu' (SwiGLU)")
    _reject(cfg, "mlp_bias", bool, "MLP biases are not supported")
    _reject(cfg, "use_sliding_window", bool, "sliding-window attention is not supported")
    _reject(cfg, "layer_types", lambda v: any(t != "full_attention" for t in v or ()),
            "only full attention in every layer (no sliding-window layers)")
    if arch in MOE_ARCHITECTURES:
        _check_moe(cfg)
    else:
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            _reject(cfg, key, bool, f"experts on {arch} are not supported (mixture-of-experts: "
                    f"{', '.join(MOE_ARCHITECTURES)})")
    if arch != "Qwen2ForCausalLM":
        _reject(cfg, "attention_bias", bool,
                f"attention biases are not supported for {arch.replace('ForCausalLM', '')}")
    parse_rope_scaling(cfg)  # raises for other RoPE types


def moe_num_experts(cfg: dict):
    """A Qwen3-MoE config.json's expert count: ``num_experts`` (the Hub's files) or
    ``num_local_experts`` (what transformers 5 writes for the same attribute)."""
    key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    return key, cfg.get(key)


def _check_moe(cfg: dict) -> None:
    """Qwen3-MoE as hybridrl builds it: every layer sparse, routed experts only."""
    key, experts = moe_num_experts(cfg)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"config.json {key}={experts!r} is not supported: a positive "
                         "number of experts")
    topk = cfg.get("num_experts_per_tok")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= experts:
        raise ValueError(f"config.json num_experts_per_tok={topk!r} is not supported: 1 .. "
                         f"num_experts ({experts})")
    ffn = cfg.get("moe_intermediate_size")
    if isinstance(ffn, bool) or not isinstance(ffn, int) or ffn < 1:
        raise ValueError(f"config.json moe_intermediate_size={ffn!r} is not supported: a "
                         "positive integer")
    _reject(cfg, "decoder_sparse_step", lambda v: v not in (None, 1),
            "only 1 (every layer a MoE layer)")
    _reject(cfg, "mlp_only_layers", bool, "only [] (every layer a MoE layer)")
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        _reject(cfg, key, bool, "shared experts are not supported (Qwen3-MoE has none)")


def _reject(cfg: dict, key: str, bad, why: str) -> None:
    if key in cfg and bad(cfg[key]):
        raise ValueError(f"config.json {key}={cfg[key]!r} is not supported: {why}")
