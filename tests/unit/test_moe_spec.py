"""Qwen3-MoE config.json -> LlamaSpec -> megatron TransformerConfig (issue 38 item 2), no ranks."""

import pytest

from hybridrl.config.model import ModelConfig
from hybridrl.models.naming import canonical_name, expert_index
from hybridrl.models.spec import LlamaSpec, check_layout, to_transformer_config
from hybridrl.parallel.layout import TrainLayout

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen3_30b_a3b_config_is_read_and_written_back():
    spec = LlamaSpec.from_hf_config(QWEN3_30B_A3B)
    assert spec.is_moe and spec.qk_norm and spec.architecture == "Qwen3MoeForCausalLM"
    assert (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size) == (128, 8, 768)
    assert spec.moe_norm_topk_prob and spec.moe_aux_loss_coef == 0.0  # no output_router_logits
    assert LlamaSpec.from_hf_config(spec.to_hf_config()) == spec
    aux = LlamaSpec.from_hf_config({**QWEN3_30B_A3B, "output_router_logits": True})
    assert aux.moe_aux_loss_coef == 0.001
    # transformers 5 writes num_local_experts for the same attribute
    renamed = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert LlamaSpec.from_hf_config({**renamed, "num_local_experts": 128}) == spec


def test_megatron_knobs_follow_qwen3_routing():
    spec = LlamaSpec.from_hf_config(QWEN3_30B_A3B)
    cfg = to_transformer_config(spec, TrainLayout(world=16, tp=2, ep=8),
                                sequence_parallel=True)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (128, 8, 768)
    assert not cfg.moe_router_pre_softmax  # top-k of the logits, softmax over k: renormalized
    assert cfg.moe_token_dispatcher_type == "alltoall" and not cfg.moe_grouped_gemm
    assert cfg.moe_router_load_balancing_type == "none" and cfg.moe_expert_capacity_factor is None
    assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (8, 2)
    plain = LlamaSpec.from_hf_config({**QWEN3_30B_A3B, "norm_topk_prob": False,
                                      "output_router_logits": True})
    cfg = to_transformer_config(plain, TrainLayout(world=1))
    assert cfg.moe_router_pre_softmax  # softmax over all experts, then top-k, no renorm
    assert cfg.moe_router_load_balancing_type == "aux_loss" and cfg.moe_aux_loss_coeff == 0.001


@pytest.mark.parametrize("change,needle", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok"),
    ({"num_experts": 0}, "num_experts"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size"),
])
def test_other_moe_variants_name_the_key(change, needle):
    with pytest.raises(ValueError, match=needle):
        LlamaSpec.from_hf_config({**QWEN3_30B_A3B, **change})


def test_layout_checks_are_one_line():
    spec = LlamaSpec.from_hf_config(QWEN3_30B_A3B)
    with pytest.raises(ValueError, match="num_experts=128 is not divisible by ep=3"):
        check_layout(spec, TrainLayout(world=3, ep=3))
    with pytest.raises(ValueError, match=r"moe_intermediate_size\)=768 is not divisible by "
                                         r"etp=5"):
        check_layout(spec, TrainLayout(world=5, tp=1, etp=5))
    with pytest.raises(ValueError, match="needs model.sequence_parallel: true"):
        to_transformer_config(spec, TrainLayout(world=2, tp=2))
    dense = LlamaSpec(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=128, vocab_size=100)
    with pytest.raises(ValueError, match="need a MoE model"):
        check_layout(dense, TrainLayout(world=2, ep=2))


def test_builtin_moe_knobs_and_dense_default():
    dense = LlamaSpec.from_model_config(ModelConfig())
    assert not dense.is_moe and dense.architecture == "LlamaForCausalLM"
    moe = LlamaSpec.from_model_config(ModelConfig(num_experts=8, moe_topk=2))
    assert moe.is_moe and moe.qk_norm and moe.moe_ffn_hidden_size == ModelConfig().ffn_hidden_size
    with pytest.raises(ValueError, match="model.moe_topk"):
        ModelConfig(num_experts=8, moe_topk=9)
    with pytest.raises(ValueError, match="need model.num_experts > 0"):
        ModelConfig(moe_topk=2)


def test_canonical_names_carry_the_global_expert():
    name = canonical_name("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", 4, 8)
    assert name == "decoder.layers.5.mlp.experts.local_experts.11.linear_fc1.weight"
    assert expert_index(name) == 11 and expert_index("decoder.layers.5.mlp.router.weight") is None


def test_moe_presets_are_the_published_configs():
    """`plan --model qwen3-30b-a3b` (reshard.specs PRESETS) is Qwen/Qwen3-30B-A3B's
    config.json read by LlamaShape.from_hf_config, under either expert-count key (transformers
    5 writes num_local_experts: the reshard read only num_experts), with its 30.5B parameters."""
    from hybridrl.reshard.specs import PRESETS, LlamaShape

    want = PRESETS["qwen3-30b-a3b"]
    assert LlamaShape.from_hf_config(QWEN3_30B_A3B) == want
    renamed = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert LlamaShape.from_hf_config({**renamed, "num_local_experts": 128}) == want
    assert round(want.num_params() / 1e9, 1) == 30.5
    big = PRESETS["qwen3-235b-a22b"]
    assert (big.num_experts, big.moe_topk, round(big.num_params() / 1e9)) == (128, 8, 235)
