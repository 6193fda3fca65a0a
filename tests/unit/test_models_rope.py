"""RoPE scaling from config.json: hybridrl's inverse frequencies equal transformers' bit for bit,
megatron's own llama3 scaling differs where its defaults do, and what is not supported is refused
with the key named."""

from __future__ import annotations

import pytest
import torch

from hybridrl.config.hf_model import RopeScaling, parse_rope_scaling
from hybridrl.models.rope import inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
CASES = [  # (model_type, head_dim, theta, max_positions, rope_scaling)
    ("llama", 128, 500000.0, 131072, LLAMA3),  # Llama 3.1 as published
    ("llama", 64, 500000.0, 131072, {**LLAMA3, "factor": 32.0}),  # Llama 3.2 1B
    ("llama", 16, 500000.0, 1024, {**LLAMA3, "original_max_position_embeddings": 64}),
    ("llama", 32, 10000.0, 4096, {**LLAMA3, "factor": 4.0, "low_freq_factor": 2.0,
                                  "high_freq_factor": 8.0, "original_max_position_embeddings": 48}),
    ("qwen2", 128, 1e6, 32768, {"type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768}),  # Qwen2.5 card
    ("qwen2", 16, 1e6, 64, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    ("qwen2", 32, 10000.0, 256, {"rope_type": "yarn", "factor": 2.5, "beta_fast": 16,
                                 "beta_slow": 2, "truncate": False}),
    ("qwen2", 64, 10000.0, 256, {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0,
                                 "mscale_all_dim": 0.5}),
    ("qwen2", 64, 10000.0, 256, {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.3}),
]


def _hf_config(model_type, head_dim, theta, max_pos, scaling):
    from transformers import LlamaConfig, Qwen2Config

    cls = LlamaConfig if model_type == "llama" else Qwen2Config
    kwargs = dict(hidden_size=4 * head_dim, num_attention_heads=4, rope_theta=theta,
                  max_position_embeddings=max_pos, rope_scaling=dict(scaling))
    if model_type == "llama":
        kwargs["head_dim"] = head_dim
    return cls(**kwargs)


@pytest.mark.parametrize("case", CASES)
def test_inv_freq_equals_transformers_bit_for_bit(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_type, hd, theta, max_pos, scaling = case
    hf = _hf_config(*case)
    want, want_factor = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
    parsed = parse_rope_scaling({"rope_scaling": dict(scaling), "max_position_embeddings": max_pos})
    got, factor = inv_freq(hd, theta, parsed, max_pos)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert factor == want_factor
    # what transformers writes back gives the same frequencies (transformers 5 writes a missing
    # yarn original context out as max_position_embeddings; hybridrl keeps it None)
    again, again_factor = inv_freq(hd, theta, parse_rope_scaling(hf.to_dict()), max_pos)
    assert torch.equal(again, got) and again_factor == factor


def test_megatron_llama3_defaults_differ_where_the_config_does():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for scaling, same in ((LLAMA3, True), ({**LLAMA3, "original_max_position_embeddings": 64},
                                          False)):
        rope = RotaryEmbedding(16, 1.0, rotary_base=500000, rope_scaling=True,
                               rope_scaling_factor=8.0, use_cpu_initialization=True)
        ours, _ = inv_freq(16, 500000.0, parse_rope_scaling({"rope_scaling": scaling}), 131072)
        assert torch.equal(rope.inv_freq, ours) == same


def test_installed_into_the_model_config():
    from hybridrl.models.spec import LlamaSpec, to_transformer_config
    from hybridrl.parallel.layout import TrainLayout

    base = dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=96, vocab_size=100, max_position_embeddings=64)
    yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=16)
    cfg = to_transformer_config(LlamaSpec(**base, rope_scaling=yarn), TrainLayout(1))
    assert cfg.softmax_scale == pytest.approx((0.1 * torch.log(torch.tensor(4.0)).item() + 1)
                                              ** 2 / 4.0)
    llama3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert to_transformer_config(LlamaSpec(**base, rope_scaling=llama3),
                                 TrainLayout(1)).softmax_scale is None


@pytest.mark.parametrize("cfg,needle", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling.rope_type='linear'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": None}}, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling.factor"),
    ({"partial_rotary_factor": 0.5, "rope_scaling": None}, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
     "rope_parameters.partial_rotary_factor"),
    ({"rope_scaling": LLAMA3, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
     "disagree"),
])
def test_refusals_name_the_key(cfg, needle):
    with pytest.raises(ValueError, match=needle):
        parse_rope_scaling(cfg)


def test_default_rope_is_none_and_to_hf_round_trips():
    assert parse_rope_scaling({}) is None
    assert parse_rope_scaling({"rope_scaling": None, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4}}) is None
    for scaling in (LLAMA3, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "truncate": False, "beta_fast": 8}):
        parsed = parse_rope_scaling({"rope_scaling": scaling})
        assert parse_rope_scaling({"rope_scaling": parsed.to_hf()}) == parsed


def test_missing_yarn_original_context_is_not_exported():
    """A yarn config without original_max_position_embeddings keeps it None: the RoPE uses
    max_position_embeddings (as transformers does) and the export does not add the key
    (transformers 4.45-4.5x would then replace factor by max / original = 1)."""
    from hybridrl.models.spec import LlamaSpec

    yarn = {"rope_type": "yarn", "factor": 4.0}
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "vocab_size": 100, "max_position_embeddings": 256, "rope_scaling": yarn}
    parsed = parse_rope_scaling(cfg)
    assert parsed.original_max_position_embeddings is None
    assert parsed.to_hf() == yarn
    exported = LlamaSpec.from_hf_config(cfg).to_hf_config()["rope_scaling"]
    assert "original_max_position_embeddings" not in exported
    explicit = parse_rope_scaling({**cfg, "rope_scaling": {**yarn,
                                                           "original_max_position_embeddings": 256}})
    assert torch.equal(inv_freq(16, 1e4, parsed, 256)[0], inv_freq(16, 1e4, explicit, 256)[0])
    # a missing factor is still max / original (transformers 5), with or without the key
    assert parse_rope_scaling({**cfg, "rope_scaling": {"rope_type": "yarn",
                                                       "original_max_position_embeddings": 64}}
                              ).factor == 4.0
    assert parse_rope_scaling({**cfg, "rope_scaling": {"rope_type": "yarn"}}).factor == 1.0
