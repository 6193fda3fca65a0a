"""Parameter specs of a llama-family megatron-core GPTModel, derived from the model shape.

Contract:
- ``LlamaShape`` is the frozen model description (hidden, ffn, heads, query groups, head_dim, vocab,
  layers, tied, megatron's ``make_vocab_size_divisible_by``, Qwen2's q/k/v bias, Qwen3's per-head
  q/k norms); ``from_hf_config`` reads an HF config.json dict of a supported family (Llama incl.
  3.x, Qwen2/2.5, Qwen3: ``hybridrl.config.hf_model``; anything else, an unsupported feature or
  a missing size is one ValueError naming the key and the file). ``PRESETS`` (read-only) holds
  the real config.json sizes of llama-3.1-8b/70b, llama-3.2-1b/3b (tied), qwen2.5-7b/72b,
  qwen3-8b/32b and the Llama 2 family as llama2-7b/13b/34b/70b; ``preset(name)`` refuses the old
  ``llama-7b``... names with a line naming the new ones; ``preset_of_folder(path)`` is the
  preset a folder name such as ``Llama-3.1-70B-Instruct`` stands for (Llama 3 and 3.3 names map
  to the 3.1 preset of the same shape).
- ``build_specs(shape, naming)`` returns one ``ParamSpec`` per logical megatron parameter, named as
  megatron-core's GPTModel names it with GLOBAL layer indices (``naming="local"``: the local layer
  spec's ``input_layernorm``/``pre_mlp_layernorm``; ``"te"``: the TE-fused ``layer_norm_weight``).
- Every parameter is described in a *canonical* full view that does not depend on any layout;
  a TP slice is always a half-open row interval ``[lo, hi)`` along the spec's ``cut_dim``:

  ====== ============================ ======= =============================================
  kind   canonical full shape          cut_dim  megatron storage of TP rank b (of n)
  ====== ============================ ======= =============================================
  qkv    [G*(hpg+2)*hd, H]            0        rows of groups [b*G/n, (b+1)*G/n), each group
         (bias: [G*(hpg+2)*hd])                [q(hpg*hd); k(hd); v(hd)] (megatron interleave)
  fc1    [2, F, H]                    1        [2, F/n, H] viewed as [gate_b; up_b] = [2F/n, H]
  row    [H, X] (proj X=heads*hd,     1        [H, X/n]
         fc2 X=F)
  vocab  [V, H] (V unpadded)          0        [chunk, H], chunk = Vpad/n; real rows
                                               [b*chunk, min((b+1)*chunk, V)), padding after
  norm   [H] ([hd]: Qwen3's q/k norm; 0        replicated, the whole vector
         [E, H]: a MoE router)
  ====== ============================ ======= =============================================

  G = num_query_groups, hpg = heads/G, hd = head_dim, F = ffn, H = hidden.
- Qwen3-MoE (``num_experts`` E > 0, every layer sparse): a layer's MLP is
  ``mlp.router.weight`` [E, H] (kind norm: replicated over tp and ep) and, per global expert e,
  ``mlp.experts.local_experts.e.linear_fc1.weight`` (kind fc1, [2, Fm, H]) and ``linear_fc2``
  (kind row, [H, Fm]) with ``expert`` = e: megatron-core's SequentialMLP names at ep = 1
  (``naming="te"``: TEGroupedMLP's ``mlp.experts.linear_fc1.weight<e>`` / ``linear_fc2``). At
  EP size ep, EP rank e // (E/ep) holds expert e as local expert e mod E/ep
  (``local_name(pp, layers, ep)``), cut over expert TP (``etp``) as a dense fc1 / fc2 over tp.
  The layer norm before the MoE is ``pre_mlp_layernorm.weight`` in both namings.
- Tied embeddings: megatron keeps a copy named ``output_layer.weight`` on the last stage only when
  pp > 1; its ``key`` is the embedding's (the same full tensor). ``on_stage`` knows this.
- Bad shapes or layouts raise ``ValueError`` naming the field and the numbers.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

from hybridrl.config.hf_model import check_hf_features, hf_architecture, moe_num_experts

KINDS = ("qkv", "fc1", "row", "vocab", "norm")
NAMINGS = ("local", "te")
EMBED = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """Sizes of a llama-family decoder (RMSNorm, SwiGLU, GQA, RoPE; Qwen2 q/k/v biases and Qwen3
    per-head q/k norms optional)."""

    hidden: int
    ffn: int
    heads: int
    num_query_groups: int
    layers: int
    vocab: int
    head_dim: int | None = None
    tied: bool = False
    make_vocab_size_divisible_by: int = 128
    qkv_bias: bool = False  # Qwen2: linear_qkv.bias, interleaved per query group like the weight
    qk_norm: bool = False  # Qwen3: q_layernorm / k_layernorm weights [head_dim], replicated
    num_experts: int = 0  # Qwen3-MoE: experts per layer (0 = dense)
    moe_topk: int = 0  # experts per token
    moe_ffn_hidden_size: int | None = None  # each expert's F (HF moe_intermediate_size)
    moe_norm_topk_prob: bool = True  # top-k probabilities renormalized (no weight, no reshard)

    def __post_init__(self) -> None:
        if self.num_experts:
            if not isinstance(self.num_experts, int) or self.num_experts < 1:
                raise ValueError(f"num_experts must be a non-negative integer, got "
                                 f"{self.num_experts!r}")
            if not isinstance(self.moe_topk, int) or not 1 <= self.moe_topk <= self.num_experts:
                raise ValueError(f"moe_topk must be in [1, num_experts={self.num_experts}], "
                                 f"got {self.moe_topk!r}")
            f = self.moe_ffn_hidden_size
            if not isinstance(f, int) or isinstance(f, bool) or f < 1:
                raise ValueError(f"moe_ffn_hidden_size must be a positive integer with experts, "
                                 f"got {f!r}")
        for f in ("hidden", "ffn", "heads", "num_query_groups", "layers", "vocab",
                  "make_vocab_size_divisible_by"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.heads % self.num_query_groups:
            raise ValueError(
                f"heads={self.heads} must be divisible by num_query_groups={self.num_query_groups}"
            )

    @property
    def heads_per_group(self) -> int:
        """Query heads per KV group (heads / num_query_groups)."""
        return self.heads // self.num_query_groups

    def padded_vocab(self, tp: int) -> int:
        """megatron's padding: round vocab up to make_vocab_size_divisible_by * tp."""
        m = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab // m) * m

    def num_params(self) -> int:
        """Number of parameters of the model (a tied output layer counted once)."""
        return sum(s.numel for s in build_specs(self) if not s.tied_copy)

    @staticmethod
    def from_hf_config(cfg: dict, source: str = "config.json") -> LlamaShape:
        """From an HF config.json dict (``source``: its path, for messages).

        The architecture and its features are checked as the model builder checks them
        (``hybridrl.config.hf_model``: e.g. Mixtral's experts, a sliding window in use or
        another RoPE type are refused); a missing or non-integer size raises ValueError naming
        the key and ``source``.
        """
        if not isinstance(cfg, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
        try:
            arch = hf_architecture(cfg)
            check_hf_features(cfg, arch)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None

        def size(key: str, default=None) -> int:
            value = cfg.get(key, default)
            if value is None:
                raise ValueError(f"{source} lacks the field {key!r}")
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
            return value

        heads = size("num_attention_heads")
        return LlamaShape(
            hidden=size("hidden_size"),
            ffn=size("intermediate_size"),
            heads=heads,
            num_query_groups=size("num_key_value_heads", heads),
            layers=size("num_hidden_layers"),
            vocab=size("vocab_size"),
            head_dim=None if cfg.get("head_dim") is None else size("head_dim"),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            **({"num_experts": size(moe_num_experts(cfg)[0]),
                "moe_topk": size("num_experts_per_tok"),
                "moe_ffn_hidden_size": size("moe_intermediate_size"),
                "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", False))}  # HF default
               if arch == "Qwen3MoeForCausalLM" else {}),
        )

    @staticmethod
    def from_model(m: object, *, vocab: int | None = None, tied: bool | None = None,
                   make_vocab_size_divisible_by: int = 128) -> LlamaShape:
        """The shape of a model from its description; ``m`` is one of:

        - hybridrl.models' ``LlamaSpec`` or the config's ``ModelConfig`` (same field names);
        - megatron-core's ``TransformerConfig``: it has no vocabulary, so ``vocab=`` (the
          unpadded vocabulary size) is required, ``tied=`` defaults to False;
        - a megatron-core ``GPTModel`` (its ``.config``, ``.vocab_size`` and
          ``.share_embeddings_and_output_weights``): its ``vocab_size`` is usually already
          padded; pass ``vocab=`` the real size to keep padding rows out of the reshard.

        ``vocab`` / ``tied`` override what ``m`` says; ``make_vocab_size_divisible_by`` is
        megatron's padding divisor (the trainer's default, 128) for a megatron ``m``. A
        megatron config that is not a llama-family decoder (LayerNorm, no gated linear unit,
        linear biases, MLA; experts other than Qwen3-MoE's: shared experts, dense layers in
        between, sigmoid routing) is one ValueError naming the field."""
        if hasattr(m, "kv_channels") or hasattr(getattr(m, "config", None), "kv_channels"):
            return _from_megatron(m, vocab, tied, make_vocab_size_divisible_by)
        try:
            return LlamaShape(
                hidden=m.hidden_size, ffn=m.ffn_hidden_size, heads=m.num_attention_heads,
                num_query_groups=m.num_query_groups, layers=m.num_layers,
                vocab=m.vocab_size if vocab is None else vocab,
                head_dim=getattr(m, "head_dim", None),
                tied=bool(m.tie_word_embeddings) if tied is None else tied,
                qkv_bias=bool(getattr(m, "qkv_bias", False)),
                qk_norm=bool(getattr(m, "qk_norm", False)),
                **_moe_fields(m),
            )
        except AttributeError as err:
            raise ValueError(f"from_model: {type(m).__name__} is not a LlamaSpec, ModelConfig, "
                             f"megatron TransformerConfig or GPTModel (lacks {err.name!r})"
                             ) from None


def _moe_fields(m) -> dict:
    """The MoE fields of a LlamaSpec / ModelConfig (absent: dense)."""
    return {"num_experts": int(getattr(m, "num_experts", 0) or 0),
            "moe_topk": int(getattr(m, "moe_topk", 0) or 0),
            "moe_ffn_hidden_size": getattr(m, "moe_ffn_hidden_size", None),
            "moe_norm_topk_prob": bool(getattr(m, "moe_norm_topk_prob", True))}


def _from_megatron(m, vocab: int | None, tied: bool | None, divisor: int) -> LlamaShape:
    """``LlamaShape.from_model`` for a megatron-core TransformerConfig or GPTModel."""
    cfg = m if hasattr(m, "kv_channels") else m.config
    if vocab is None:
        vocab = getattr(m, "vocab_size", None)
        if vocab is None:
            raise ValueError("from_model(TransformerConfig) needs vocab=: megatron keeps the "
                             "vocabulary size on the GPTModel, not in its config")
    if tied is None:
        tied = bool(getattr(m, "share_embeddings_and_output_weights", False))
    llama = {"normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False,
             "multi_latent_attention": False, "moe_shared_expert_intermediate_size": None,
             "moe_layer_freq": 1}
    experts = int(getattr(cfg, "num_moe_experts", None) or 0)
    if experts:  # Qwen3-MoE: softmax routing, every layer sparse, no shared expert
        llama["moe_router_score_function"] = "softmax"
    for field, want in llama.items():
        got = getattr(cfg, field, want)
        if got != want:
            raise ValueError(f"from_model: {field}={got!r} is not a llama-family decoder "
                             f"(the reshard describes {field}={want!r})")
    heads = cfg.num_attention_heads
    return LlamaShape(
        hidden=cfg.hidden_size, ffn=cfg.ffn_hidden_size, heads=heads,
        num_query_groups=cfg.num_query_groups or heads, layers=cfg.num_layers, vocab=vocab,
        head_dim=cfg.kv_channels, tied=tied, make_vocab_size_divisible_by=divisor,
        qkv_bias=bool(getattr(cfg, "add_qkv_bias", False)),
        qk_norm=bool(getattr(cfg, "qk_layernorm", False)),
        **({"num_experts": experts, "moe_topk": cfg.moe_router_topk,
            "moe_ffn_hidden_size": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            # softmax after the top-k renormalizes it (Qwen3's norm_topk_prob)
            "moe_norm_topk_prob": not cfg.moe_router_pre_softmax} if experts else {}),
    )


def _presets() -> dict[str, LlamaShape]:
    """The published config.json sizes (hidden, ffn, heads, kv heads, layers, vocab; head_dim,
    tie, biases, q/k norms where they differ from the defaults)."""
    S = LlamaShape
    return {
        "llama-3.1-8b": S(4096, 14336, 32, 8, 32, 128256),
        "llama-3.1-70b": S(8192, 28672, 64, 8, 80, 128256),
        "llama-3.2-1b": S(2048, 8192, 32, 8, 16, 128256, head_dim=64, tied=True),
        "llama-3.2-3b": S(3072, 8192, 24, 8, 28, 128256, head_dim=128, tied=True),
        "qwen2.5-7b": S(3584, 18944, 28, 4, 28, 152064, qkv_bias=True),
        "qwen2.5-72b": S(8192, 29568, 64, 8, 80, 152064, qkv_bias=True),
        "qwen3-8b": S(4096, 12288, 32, 8, 36, 151936, head_dim=128, qk_norm=True),
        "qwen3-32b": S(5120, 25600, 64, 8, 64, 151936, head_dim=128, qk_norm=True),
        # Qwen3-MoE: 128 routed experts per layer of width moe_intermediate_size, top-8
        "qwen3-30b-a3b": S(2048, 6144, 32, 4, 48, 151936, head_dim=128, qk_norm=True,
                           num_experts=128, moe_topk=8, moe_ffn_hidden_size=768),
        "qwen3-235b-a22b": S(4096, 12288, 64, 4, 94, 151936, head_dim=128, qk_norm=True,
                             num_experts=128, moe_topk=8, moe_ffn_hidden_size=1536),
        "llama2-7b": S(4096, 11008, 32, 32, 32, 32000),
        "llama2-13b": S(5120, 13824, 40, 40, 40, 32000),
        "llama2-34b": S(8192, 22016, 64, 8, 48, 32000),  # CodeLlama-34B
        "llama2-70b": S(8192, 28672, 64, 8, 80, 32000),
    }


PRESETS = MappingProxyType(_presets())  # read-only: no module state to mutate
RENAMED_PRESETS = MappingProxyType({f"llama-{size}": f"llama2-{size}"
                                    for size in ("7b", "13b", "34b", "70b")})
SAME_SHAPE = MappingProxyType({"llama-3.3-70b": "llama-3.1-70b",  # a folder name -> its preset
                               "llama-3-8b": "llama-3.1-8b", "llama-3-70b": "llama-3.1-70b"})


def preset_of_folder(path: str) -> str | None:
    """The preset a model folder's name stands for (``.../Llama-3.1-70B-Instruct`` and
    ``Llama-3.3-70B-Instruct`` -> ``llama-3.1-70b``, ``Llama-3.2-1B`` -> ``llama-3.2-1b``,
    ``Qwen/Qwen3-8B`` -> ``qwen3-8b``), or None."""
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    for prefix in ("meta-",):
        name = name.removeprefix(prefix)
    for suffix in ("-instruct", "-chat", "-base"):
        name = name.removesuffix(suffix)
    name = SAME_SHAPE.get(name, name)
    return name if name in PRESETS else None


def preset(name: str) -> LlamaShape:
    """The preset called ``name``; an old Llama-2 name is refused with a line naming the new
    one (e.g. llama-70b is llama2-70b, Llama-3.1-70B is llama-3.1-70b)."""
    if name in RENAMED_PRESETS:
        size = name.split("-", 1)[1]
        llama3 = f" (Llama 3.1: llama-3.1-{size})" if f"llama-3.1-{size}" in PRESETS else ""
        raise ValueError(f"preset {name!r} was renamed {RENAMED_PRESETS[name]!r} (Llama 2, vocab "
                         f"32000){llama3}; presets: {', '.join(PRESETS)}")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One megatron parameter: canonical full ``shape``, TP cut along ``cut_dim`` (see module doc)."""

    name: str  # megatron name, global layer index
    key: str  # full-weights key (tied output -> the embedding's)
    kind: str
    shape: tuple[int, ...]
    cut_dim: int
    layer: int | None = None  # None: embedding (first stage) / final norm, output (last stage)
    last_stage: bool = False
    tied_copy: bool = False
    unit: int = 1  # TP slices are whole multiples of ``unit`` rows (a qkv query group)
    expert: int | None = None  # MoE: the global expert index (named so: its ep = 1 name)
    num_experts: int = 0  # MoE: experts per layer (for the local index at ep > 1)

    @property
    def numel(self) -> int:
        """Elements of the full canonical tensor."""
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Rows along ``cut_dim`` (the unit a TP slice and a transfer are counted in)."""
        return self.shape[self.cut_dim]

    @property
    def row_numel(self) -> int:
        """Elements per row along ``cut_dim``."""
        return self.numel // self.rows

    def piece_shape(self, rows: int) -> tuple[int, ...]:
        """Canonical shape of a piece of ``rows`` rows along ``cut_dim``."""
        s = list(self.shape)
        s[self.cut_dim] = rows
        return tuple(s)

    def stage(self, pp: int, num_layers: int) -> int:
        """The pipeline stage of ``pp`` that holds this parameter (megatron's even split)."""
        if self.layer is None:
            return pp - 1 if self.last_stage else 0
        return self.layer // (num_layers // pp)

    def on_stage(self, pp: int, num_layers: int, stage: int) -> bool:
        """Whether megatron holds this parameter on ``stage`` of ``pp`` stages."""
        if self.tied_copy and pp == 1:
            return False  # megatron reuses the embedding when one stage holds both ends
        return self.stage(pp, num_layers) == stage

    def tp_interval(self, n: int, b: int, vocab_chunk: int | None = None) -> tuple[int, int]:
        """Real rows [lo, hi) of TP rank b of n (vocab: chunk rows per rank, clipped to V)."""
        if self.kind == "norm":
            return 0, self.rows
        if self.kind == "vocab":
            lo = min(b * vocab_chunk, self.rows)
            return lo, min(lo + vocab_chunk, self.rows)
        per = self.rows // n
        return b * per, (b + 1) * per

    def local_name(self, pp: int, num_layers: int, ep: int = 1) -> str:
        """The name megatron gives it on its stage (layer index local to the stage; an expert's
        index local to its EP rank: global e is local expert e mod E/ep)."""
        if self.layer is None:
            return self.name
        offset = self.stage(pp, num_layers) * (num_layers // pp)
        name = self.name.replace(f"layers.{self.layer}.", f"layers.{self.layer - offset}.", 1)
        if self.expert is not None and ep > 1:
            local = self.expert % (self.num_experts // ep)
            if "local_experts." in name:  # SequentialMLP
                name = name.replace(f"local_experts.{self.expert}.", f"local_experts.{local}.", 1)
            else:  # TEGroupedMLP: ...linear_fc1.weight<e>
                name = name.removesuffix(str(self.expert)) + str(local)
        return name

    def ep_rank(self, ep: int) -> int | None:
        """The EP rank of ``ep`` holding this expert (None: not an expert parameter)."""
        return None if self.expert is None else self.expert // (self.num_experts // ep)

    def part_intervals(self, lo: int, hi: int, parts: int,
                       vocab_chunk: int) -> list[tuple[int, int]]:
        """Canonical rows of each of ``parts`` consecutive parts of a gen shard's rows [lo, hi)
        (a shard kept as ``parts`` sub-shards of TP size tp·parts; vocabulary: ``vocab_chunk /
        parts`` rows each, real rows only, so a part past the vocabulary is empty (a, a))."""
        c = vocab_chunk // parts if self.kind == "vocab" else (hi - lo) // parts
        return [(lo + k * c, max(lo + k * c, min(hi, lo + (k + 1) * c))) for k in range(parts)]


def check_split(shape: LlamaShape, tp: int, pp: int, what: str = "train") -> None:
    """ValueError unless megatron can shard ``shape`` with (tp, pp)."""
    if shape.num_query_groups % tp:
        raise ValueError(
            f"{what} tp={tp} cannot split num_query_groups={shape.num_query_groups} KV heads: "
            f"need num_query_groups % tp == 0"
        )
    if shape.ffn % tp:
        raise ValueError(f"{what} tp={tp} must divide ffn={shape.ffn}")
    if shape.layers % pp:
        raise ValueError(f"{what} pp={pp} must divide layers={shape.layers}")
    if what == "gen":  # the engines split each expert's F over gen tp (training: etp, ep)
        check_expert_split(shape, tp, 1, what)


def check_expert_split(shape: LlamaShape, etp: int, ep: int, what: str = "train") -> None:
    """ValueError unless the experts split over expert TP ``etp`` and EP ``ep``."""
    if not shape.num_experts:
        if ep != 1:
            raise ValueError(f"{what} ep={ep} needs a mixture-of-experts model (num_experts > 0)")
        return
    if shape.num_experts % ep:
        raise ValueError(f"{what} ep={ep} must divide num_experts={shape.num_experts}")
    if shape.moe_ffn_hidden_size % etp:
        raise ValueError(f"{what} expert tp={etp} must divide "
                         f"moe_ffn_hidden_size={shape.moe_ffn_hidden_size}")


def _layer_specs(s: LlamaShape, layer: int, naming: str) -> list[ParamSpec]:
    p = f"decoder.layers.{layer}."
    if naming == "te":
        ln1, ln2 = "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    else:
        ln1, ln2 = "input_layernorm.weight", "pre_mlp_layernorm.weight"
    group_rows = (s.heads_per_group + 2) * s.head_dim
    H = s.hidden

    def spec(suffix, kind, shape, cut, unit=1):
        return ParamSpec(p + suffix, p + suffix, kind, shape, cut, layer=layer, unit=unit)

    qkv_extras = [spec("self_attention.linear_qkv.bias", "qkv", (s.num_query_groups * group_rows,),
                       0, unit=group_rows)] if s.qkv_bias else []  # Qwen2
    qkv_extras += [spec(f"self_attention.{n}_layernorm.weight", "norm", (s.head_dim,), 0)
                   for n in ("q", "k")] if s.qk_norm else []  # Qwen3
    if s.num_experts:  # a MoE layer: megatron has no fused norm there in either naming
        ln2 = "pre_mlp_layernorm.weight"
    return [
        spec(ln1, "norm", (H,), 0),
        spec("self_attention.linear_qkv.weight", "qkv",
             (s.num_query_groups * group_rows, H), 0, unit=group_rows),
        *qkv_extras,
        spec("self_attention.linear_proj.weight", "row", (H, s.heads * s.head_dim), 1),
        spec(ln2, "norm", (H,), 0),
        *(_moe_specs(s, layer, naming) if s.num_experts else [
            spec("mlp.linear_fc1.weight", "fc1", (2, s.ffn, H), 1),
            spec("mlp.linear_fc2.weight", "row", (H, s.ffn), 1)]),
    ]


def _moe_specs(s: LlamaShape, layer: int, naming: str) -> list[ParamSpec]:
    """A MoE layer's router (replicated over tp and ep: kind norm, [E, H]) and every expert's
    fc1 / fc2, named with the global expert index (their ep = 1 names): SequentialMLP's
    ``experts.local_experts.e.linear_fc1.weight`` (local), TEGroupedMLP's
    ``experts.linear_fc1.weight<e>`` (te)."""
    p, H, E, F = f"decoder.layers.{layer}.mlp.", s.hidden, s.num_experts, s.moe_ffn_hidden_size
    out = [ParamSpec(p + "router.weight", p + "router.weight", "norm", (E, H), 0, layer=layer)]
    for e in range(E):
        fc1, fc2 = ((f"{p}experts.linear_fc1.weight{e}", f"{p}experts.linear_fc2.weight{e}")
                    if naming == "te" else (f"{p}experts.local_experts.{e}.linear_fc1.weight",
                                            f"{p}experts.local_experts.{e}.linear_fc2.weight"))
        out += [ParamSpec(fc1, fc1, "fc1", (2, F, H), 1, layer=layer, expert=e, num_experts=E),
                ParamSpec(fc2, fc2, "row", (H, F), 1, layer=layer, expert=e, num_experts=E)]
    return out


def build_specs(shape: LlamaShape, naming: str = "local") -> list[ParamSpec]:
    """Every logical GPTModel parameter, in megatron's order (embedding, layers, norm, output)."""
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
    H, V = shape.hidden, shape.vocab
    specs = [ParamSpec(EMBED, EMBED, "vocab", (V, H), 0)]
    for layer in range(shape.layers):
        specs += _layer_specs(shape, layer, naming)
    specs.append(ParamSpec(FINAL_NORM, FINAL_NORM, "norm", (H,), 0, last_stage=True))
    if shape.tied:
        specs.append(ParamSpec(OUTPUT, EMBED, "vocab", (V, H), 0, last_stage=True, tied_copy=True))
    else:
        specs.append(ParamSpec(OUTPUT, OUTPUT, "vocab", (V, H), 0, last_stage=True))
    return specs


def storage_shape(spec: ParamSpec, n: int, vocab_chunk: int | None = None) -> tuple[int, ...]:
    """Shape of megatron's tensor on one TP rank of n (vocab: ``vocab_chunk`` rows, padded)."""
    if spec.kind == "vocab":
        return (vocab_chunk, spec.shape[1])
    if spec.kind == "norm":
        return spec.shape
    if spec.kind == "fc1":
        return (2 * spec.shape[1] // n, spec.shape[2])
    return spec.piece_shape(spec.rows // n)


def canonical_view(spec: ParamSpec, storage, real_rows: int):
    """View of a megatron storage tensor in the canonical layout (padding rows dropped)."""
    if spec.kind == "vocab":
        return storage[:real_rows]
    if spec.kind == "fc1":
        return storage.view(2, storage.shape[0] // 2, storage.shape[1])
    return storage


def to_storage(spec: ParamSpec, piece, vocab_chunk: int | None = None):
    """Inverse of ``canonical_view``: megatron storage from a canonical piece (pads vocab with 0)."""
    if spec.kind == "vocab":
        out = piece.new_zeros((vocab_chunk, piece.shape[1]))
        out[: piece.shape[0]] = piece
        return out
    if spec.kind == "fc1":
        return piece.reshape(2 * piece.shape[1], piece.shape[2])
    return piece
