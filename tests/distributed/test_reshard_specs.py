"""Spec names and shapes against a real megatron-core GPTModel built on CPU (local layer spec).

Two gloo ranks, one group, five cases: (tp, pp) = (1, 1) untied and tied, (1, 2) tied (the last
stage's output_layer copy, stage-local layer names), (2, 1) (TP shapes, padded vocab) and (2, 1)
with Qwen2's linear_qkv.bias. Each
rank compares the model's named_parameters {name: shape} with the specs' local names and
``storage_shape``. megatron's CUDA assumptions are handled by hybridrl's one compatibility
module (hybridrl.models.cpu_compat), as for every model hybridrl builds.
"""

import pytest

from hybridrl.testing.dist import run_on_ranks

CASES = [(1, 1, False, False), (1, 1, True, False), (1, 2, True, False), (2, 1, False, False),
         (2, 1, False, True)]  # (tp, pp, tied, qkv_bias)


def _build(tp, pp, tied, shape, qkv_bias=False):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, add_qkv_bias=qkv_bias,
    )
    from megatron.core import parallel_state as ps

    from hybridrl.models import cpu_compat

    cpu_compat.seed_cpu_rng_tracker(1, ps.get_tensor_model_parallel_rank())
    with cpu_compat.cpu_model_construction():  # tied + pp > 1: the output copy's .cuda()
        return _gpt(GPTModel, cfg, get_gpt_layer_local_spec, shape, tp, tied, ps)


def _gpt(GPTModel, cfg, get_gpt_layer_local_spec, shape, tp, tied, ps):
    return GPTModel(
        cfg, get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.padded_vocab(tp), max_sequence_length=64,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=tied, position_embedding_type="rope",
    )


def _specs_rank(rank, world, cases):
    from hybridrl.models import cpu_compat
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.parallel.megatron import apply_megatron_groups, clear_megatron_groups
    from hybridrl.reshard.placement import train_placement
    from hybridrl.reshard.specs import LlamaShape, build_specs, storage_shape

    cpu_compat.install()
    out = []
    for tp, pp, tied, qkv_bias in cases:
        shape = LlamaShape(hidden=64, ffn=96, heads=8, num_query_groups=2, layers=4, vocab=100,
                           head_dim=16, tied=tied, make_vocab_size_divisible_by=8, qkv_bias=qkv_bias)
        layout = TrainLayout(world, tp=tp, pp=pp)
        apply_megatron_groups(build_groups(layout))
        model = _build(tp, pp, tied, shape, qkv_bias)
        got = {n: tuple(p.shape) for n, p in model.named_parameters()}
        place = train_placement(layout, shape)
        b, a, _ = place.coords[rank]
        want = {}
        for spec in build_specs(shape):
            if spec.on_stage(pp, shape.layers, a):
                want[spec.local_name(pp, shape.layers)] = storage_shape(spec, tp, place.vocab_chunk)
        out.append((got, want))
        clear_megatron_groups()
    return out


@pytest.mark.slow
def test_specs_match_megatron_gptmodel():
    per_rank = run_on_ranks(_specs_rank, 2, CASES, timeout=300)
    for rank, results in enumerate(per_rank):
        for case, (got, want) in zip(CASES, results):
            assert got == want, (case, rank, sorted(set(got) ^ set(want)))
