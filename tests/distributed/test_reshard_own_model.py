"""docs/reshard_own_model.md runs as printed: its python blocks on 2 gloo ranks, a real GPTModel.

Each rank builds a megatron-core GPTModel (local layer spec, tp 2, vocab 100 padded with divisor
8, untied) as any megatron trainer would (hybridrl's CPU compatibility module stands in for the
GPU set-up), fills its parameters with the independent oracle's shards of seeded HF weights
(tests/unit/test_reshard_oracle.py), then runs the page's code: ``make_plan`` to gen tp 1,
``MyEngine`` + ``my_format`` + ``sync``. The engine's tensors must be bit-identical to the
oracle's engine-format tensors under the page's prefix, and each rank must have received less
than the whole model. The page's "wrong description" example must raise, on both ranks, exactly
the line the page prints.
"""

import os
import re

from hybridrl.testing.dist import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "reshard_own_model.md")


def _blocks(kind):
    with open(PAGE, encoding="utf-8") as f:
        return re.findall(rf"```{kind}\n(.*?)```", f.read(), flags=re.S)


def _gpt_model(shape, tp):
    """A megatron-core GPTModel of ``shape`` at TP ``tp`` on this rank (CPU)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from hybridrl.models import cpu_compat

    cfg = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        use_cpu_initialization=True, tensor_model_parallel_size=tp, pipeline_dtype=torch.float32)
    cpu_compat.seed_cpu_rng_tracker(1, ps.get_tensor_model_parallel_rank())
    with cpu_compat.cpu_model_construction():
        return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"),
                        vocab_size=shape.padded_vocab(tp), max_sequence_length=64,
                        share_embeddings_and_output_weights=False,
                        position_embedding_type="rope")


def _page_rank(rank, world, code):
    import torch

    from hybridrl.models import cpu_compat
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.parallel.megatron import apply_megatron_groups, clear_megatron_groups
    from hybridrl.reshard.specs import LlamaShape
    from tests.unit.test_reshard_oracle import engine_shards, make_hf, megatron_shards, mismatches

    shape = LlamaShape(hidden=64, ffn=96, heads=8, num_query_groups=2, layers=4, vocab=100,
                       head_dim=16, make_vocab_size_divisible_by=8)
    cpu_compat.install()
    apply_megatron_groups(build_groups(TrainLayout(world, tp=2)))
    try:
        model = _gpt_model(shape, 2)
        hf = make_hf(shape, seed=11)
        shards = megatron_shards(shape, hf, 2, rank, 1, 0, shape.padded_vocab(2) // 2)
        params = dict(model.named_parameters())
        assert params.keys() == shards.keys(), sorted(params.keys() ^ shards.keys())
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(shards[name])
        page: dict = {}
        exec(compile(code, PAGE, "exec"), page)  # noqa: S102  (the page's own code)
        got_shape, plan = page["make_plan"](model, world, tp=2, pp=1, gen_tp=1, vocab=100,
                                            divisor=8)
        engine = page["MyEngine"]()
        stats = page["sync"](plan, got_shape, model, engine)
        want = engine_shards(shape, hf, 1, 0, 1, 0, plan.gen.vocab_chunk)
        bad = mismatches(engine.weights, {"my_engine." + k: v for k, v in want.items()})
        model_bytes = sum(v.numel() * 4 for v in hf.values())
        try:
            wrong_plan = page["wrong_divisor"](model, world)[1]
            page["sync"](wrong_plan, got_shape, model, page["MyEngine"]())
            wrong = None
        except ValueError as err:
            wrong = f"ValueError: {err}"
        return {"shape": got_shape == shape, "bad": bad, "strategy": plan.strategy,
                "received": (stats.bytes_received, model_bytes), "wrong": wrong}
    finally:
        clear_megatron_groups()


def test_own_model_page_runs_as_printed():
    code = "\n".join(_blocks("python"))
    assert "def sync(" in code and "class MyEngine" in code
    (line,) = [b.strip() for b in _blocks("text") if b.startswith("ValueError")]
    per_rank = run_on_ranks(_page_rank, 2, code, timeout=300)
    for rank, r in enumerate(per_rank):
        assert r["shape"] and r["strategy"] == "zero_redundancy", (rank, r)
        assert r["bad"] == [], (rank, r["bad"][:5])
        assert 0 < r["received"][0] < r["received"][1], (rank, r["received"])
        assert r["wrong"] == line, (rank, r["wrong"])
