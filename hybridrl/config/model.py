"""Model section: which policy network to train.

Contract: ``ModelConfig`` names either a local HF folder (``path``; sizes then come from its
config.json and the size fields here are ignored) or, with ``path`` empty, the builtin llama-family
model whose sizes are the fields below (defaults: a tiny model that trains on a CPU in seconds).
``num_experts`` > 0 makes the builtin model a Qwen3-MoE (q/k norm; every layer ``num_experts``
routed SwiGLU experts of width ``moe_ffn_hidden_size``, top-``moe_topk`` routing); 0 keeps the
dense builtin llama exactly as before. ``__post_init__`` checks the builtin sizes (head
divisibility, GQA grouping, top-k within the experts) and the dtype; checks that involve the
parallel layout live in ``HybridRLConfig`` (and ``hybridrl.models.spec.check_layout``).
"""

from dataclasses import dataclass

from hybridrl.config._fields import check_choice, check_positive, knob

DTYPES = ("fp32", "bf16", "fp16")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class ModelConfig:
    """The policy model (actor; the critic and reference start from it unless told otherwise)."""

    path: str = knob("", "Local HF folder (config.json + *.safetensors) of a Llama/Qwen2-style "
                     "model; empty = the builtin llama with the sizes below.")
    tokenizer_path: str = knob("", "Local HF tokenizer folder; empty = `model.path` when set, "
                               "else the builtin character-level tokenizer.")
    hidden_size: int = knob(64, "Builtin model: hidden size.")
    num_layers: int = knob(4, "Builtin model: number of transformer layers.")
    num_attention_heads: int = knob(4, "Builtin model: number of query heads.")
    num_query_groups: int = knob(2, "Builtin model: number of key/value heads (GQA groups); "
                                 "equal to num_attention_heads for plain multi-head attention.")
    ffn_hidden_size: int = knob(128, "Builtin model: SwiGLU intermediate size.")
    vocab_size: int = knob(100, "Builtin model: vocabulary size (before megatron's TP padding); "
                           "must cover the tokenizer (the builtin char tokenizer: exactly 100).")
    max_position_embeddings: int = knob(1024, "Builtin model: longest sequence (prompt + "
                                        "response) the model is built for.")
    rope_theta: float = knob(10000.0, "Builtin model: RoPE base.")
    norm_eps: float = knob(1e-5, "Builtin model: RMSNorm epsilon.")
    tie_word_embeddings: bool = knob(False, "Builtin model: share the input embedding with "
                                     "the output layer.")
    num_experts: int = knob(0, "Builtin model: routed experts per layer (a tiny Qwen3-MoE, "
                            "with q/k norm); 0 = the dense builtin llama.")
    moe_topk: int = knob(0, "Builtin MoE model: experts per token (num_experts_per_tok); "
                         "needs num_experts > 0.")
    moe_ffn_hidden_size: int | None = knob(None, "Builtin MoE model: each expert's SwiGLU "
                                           "width (moe_intermediate_size); null = "
                                           "ffn_hidden_size.")
    moe_norm_topk_prob: bool = knob(True, "Builtin MoE model: renormalize the top-k routing "
                                    "weights to sum to 1 (Qwen3's norm_topk_prob).")
    moe_aux_loss_coef: float = knob(0.0, "Builtin MoE model: load-balancing (aux) loss "
                                    "coefficient (megatron's switch aux loss); 0 = none.")
    dtype: str = knob("fp32", "Parameter/compute dtype: fp32 | bf16 | fp16 (optimizer state "
                      "stays fp32).")
    recompute_granularity: str = knob("none", "Activation recompute of the trained models: none "
                                      "| selective (core attention) | full (whole layers).")
    recompute_method: str = knob("uniform", "Full recompute: uniform (chunks of "
                                 "recompute_num_layers layers) | block (the first "
                                 "recompute_num_layers layers of each stage).")
    recompute_num_layers: int = knob(1, "Full recompute: layers per chunk (uniform) or per "
                                     "stage (block).")
    sequence_parallel: bool = knob(False, "Split activations outside TP regions along the "
                                   "sequence (needs parallel.tp > 1; TE spec on GPU, the "
                                   "local spec's SP norms on CPU).")
    pack_sequences: bool = knob(True, "Training and log-prob forwards (actor, critic, "
                                "reference, reward model) run micro-batches as packs of whole "
                                "sequences (THD, cu_seqlens) instead of right-padded rows: no "
                                "pad token is computed and token budgets count real tokens.")
    share_prompts: bool = knob(True, "With pack_sequences: rows of one micro-batch that share "
                               "a prompt (rollout.n > 1) compute the prompt once and each "
                               "response attends to its keys/values (exact). Off by itself on "
                               "the TE spec, with router replay, recompute or megatron's own "
                               "attention forward.")

    def __post_init__(self) -> None:
        check_choice("model.dtype", self.dtype, DTYPES)
        check_choice("model.recompute_granularity", self.recompute_granularity,
                     RECOMPUTE_GRANULARITIES)
        check_choice("model.recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        check_positive("model.recompute_num_layers", self.recompute_num_layers)
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size", "vocab_size", "max_position_embeddings", "rope_theta",
                     "norm_eps"):
            check_positive(f"model.{name}", getattr(self, name))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({self.num_attention_heads})")
        if self.num_experts < 0 or self.moe_aux_loss_coef < 0:
            raise ValueError(f"model.num_experts ({self.num_experts}) and model."
                             f"moe_aux_loss_coef ({self.moe_aux_loss_coef}) must be >= 0")
        if self.num_experts and not 1 <= self.moe_topk <= self.num_experts:
            raise ValueError(f"model.moe_topk ({self.moe_topk}) must be in 1..model.num_experts "
                             f"({self.num_experts})")
        if not self.num_experts and (self.moe_topk or self.moe_ffn_hidden_size is not None
                                     or self.moe_aux_loss_coef):
            raise ValueError("model.moe_topk / moe_ffn_hidden_size / moe_aux_loss_coef need "
                             "model.num_experts > 0")
        if self.moe_ffn_hidden_size is not None:
            check_positive("model.moe_ffn_hidden_size", self.moe_ffn_hidden_size)
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"model.num_query_groups ({self.num_query_groups})")

    @property
    def is_builtin(self) -> bool:
        """True when the builtin model (sizes above) is used instead of an HF folder."""
        return not self.path
