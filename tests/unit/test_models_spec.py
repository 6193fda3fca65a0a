"""LlamaSpec from HF configs, layout validation before any weight is read, megatron's config."""

import json

import pytest
import torch

from hybridrl.models.spec import (
    LlamaSpec,
    check_layout,
    padded_vocab_size,
    read_hf_spec,
    to_transformer_config,
)
from hybridrl.parallel.layout import TrainLayout

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 96, "vocab_size": 100, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
}


class _Groups:  # build_from_hf only needs .train before it reads anything
    def __init__(self, train):
        self.train = train


def _folder(tmp_path, **overrides):
    cfg = {**LLAMA, **overrides}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    return tmp_path


def test_from_hf_config_llama_and_qwen2():
    spec = LlamaSpec.from_hf_config(LLAMA)
    assert (spec.num_query_groups, spec.head_dim, spec.rope_theta) == (2, 16, 5e5)
    assert not spec.qkv_bias and spec.heads_per_group == 2
    qwen = LlamaSpec.from_hf_config({**LLAMA, "architectures": ["Qwen2ForCausalLM"],
                                     "model_type": "qwen2", "rope_theta": 1e6,
                                     "rope_parameters": None})
    assert qwen.qkv_bias and qwen.rope_theta == 1e6
    assert LlamaSpec.from_hf_config(spec.to_hf_config()) == spec
    assert LlamaSpec.from_hf_config(qwen.to_hf_config("bf16")) == qwen


def test_from_hf_config_llama3_and_qwen3():
    from hybridrl.config.hf_model import RopeScaling

    llama3 = LlamaSpec.from_hf_config({**LLAMA, "rope_parameters": None, "rope_theta": 5e5,
                                       "rope_scaling": {
                                           "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "rope_type": "llama3",
                                           "original_max_position_embeddings": 8192},
                                       "tie_word_embeddings": True})
    assert llama3.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert llama3.tie_word_embeddings and not llama3.qk_norm and not llama3.qkv_bias
    qwen3 = LlamaSpec.from_hf_config({**LLAMA, "architectures": ["Qwen3ForCausalLM"],
                                      "model_type": "qwen3", "head_dim": 32,
                                      "attention_bias": False, "use_sliding_window": False,
                                      "sliding_window": None, "max_window_layers": 4,
                                      "layer_types": ["full_attention"] * 4})
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32
    assert qwen3.rope_scaling is None
    for spec in (llama3, qwen3):
        assert LlamaSpec.from_hf_config(spec.to_hf_config()) == spec
    cfg = to_transformer_config(qwen3, TrainLayout(world=2, tp=2))
    assert cfg.qk_layernorm and cfg.kv_channels == 32 and cfg.softmax_scale is None


@pytest.mark.parametrize("overrides,needle", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "rope_type 'llama3'"),
    ({"num_key_value_heads": 3}, "num_query_groups"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
      "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 2},
     "decoder_sparse_step"),
    ({"architectures": ["Qwen3ForCausalLM"], "num_experts": 8}, "num_experts"),
    ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "attention_bias"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_hf_configs_name_the_field(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        LlamaSpec.from_hf_config({**LLAMA, **overrides})


@pytest.mark.parametrize("tp,pp,needle", [
    (4, 1, r"num_query_groups \(num_key_value_heads\)=2 is not divisible by tp=4"),
    (8, 1, r"num_attention_heads=4 is not divisible by tp=8"),
    (1, 3, r"num_layers \(num_hidden_layers\)=4 is not divisible by pp=3"),
])
def test_layout_errors_come_before_any_weight_is_read(tmp_path, tp, pp, needle):
    from hybridrl.models.hf_io import build_from_hf

    folder = _folder(tmp_path)  # the weights file is garbage: reading it would fail differently
    train = TrainLayout(world=tp * pp, tp=tp, pp=pp)
    with pytest.raises(ValueError, match=needle):
        build_from_hf(str(folder), _Groups(train))


def test_unsupported_architecture_fails_before_weights(tmp_path):
    from hybridrl.models.hf_io import build_from_hf

    folder = _folder(tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        build_from_hf(str(folder), _Groups(TrainLayout(world=1)))


def test_missing_config_json(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        read_hf_spec(tmp_path)


def test_ffn_divisibility():
    spec = LlamaSpec.from_hf_config({**LLAMA, "intermediate_size": 91})
    with pytest.raises(ValueError, match=r"ffn_hidden_size.*=91 is not divisible by tp=2"):
        check_layout(spec, TrainLayout(world=2, tp=2))


@pytest.mark.parametrize("vocab,tp,padded", [(100, 1, 128), (100, 2, 256), (256, 2, 256),
                                             (151936, 8, 152576), (32000, 4, 32256)])
def test_padded_vocab_size_is_megatrons_rule(vocab, tp, padded):
    assert padded_vocab_size(vocab, tp) == padded
    assert padded % (128 * tp) == 0


def test_to_transformer_config():
    spec = LlamaSpec.from_hf_config({**LLAMA, "head_dim": 32})
    cfg = to_transformer_config(spec, TrainLayout(world=4, tp=2, pp=2), "bf16")
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.ffn_hidden_size) == (2, 32, 96)
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and not cfg.add_bias_linear
    assert cfg.params_dtype == torch.bfloat16 and cfg.bf16
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 2)
    with pytest.raises(ValueError, match="dtype"):
        to_transformer_config(spec, TrainLayout(world=1), "fp8")


def test_from_model_config_builtin_sizes():
    from hybridrl.config.model import ModelConfig

    mc = ModelConfig()
    spec = LlamaSpec.from_model_config(mc)
    assert (spec.hidden_size, spec.num_layers, spec.num_query_groups) == (
        mc.hidden_size, mc.num_layers, mc.num_query_groups)
    assert spec.vocab_size == mc.vocab_size and spec.tie_word_embeddings == mc.tie_word_embeddings
