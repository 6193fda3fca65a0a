"""The reshard's entry points as another trainer calls them (no process group).

- ``LlamaShape.from_model`` takes megatron-core's TransformerConfig (``vocab=`` required: the
  config has none) and a GPTModel (its config, vocab_size and tying), and refuses a config that
  is not a llama-family decoder with one line naming the field;
- ``plan_reshard``'s ``strategy="auto"`` is the trainer's choice (zero_redundancy where it
  applies, else p2p; split for disjoint rank sets) and gives the same plan as naming it;
  ``gen_placement``'s default grouping is the one that strategy needs (hybridflow when nested,
  else optimal, as ``default_gen_placement``);
- ``train_sources`` keeps a wrong tensor in ``.error`` (run_plan reports it on every rank), and
  needs ``rank=`` when torch.distributed is not initialized.
"""

import dataclasses
import types

import pytest
import torch

from hybridrl.parallel.layout import TrainLayout
from hybridrl.reshard import LlamaShape, build_specs, gen_placement, plan_reshard, train_placement
from hybridrl.reshard.executor import train_sources
from hybridrl.reshard.placement import default_gen_placement, split_placements
from tests.unit.test_reshard_oracle import SMALL, make_hf, megatron_shards


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=8, hidden_size=32, num_attention_heads=16, num_query_groups=8,
              kv_channels=4, ffn_hidden_size=48, normalization="RMSNorm", gated_linear_unit=True,
              add_bias_linear=False, add_qkv_bias=True, use_cpu_initialization=True)
    return TransformerConfig(**{**kw, **overrides})


def test_from_model_reads_megatron_transformer_config_and_gptmodel():
    cfg = _config()
    want = dataclasses.replace(SMALL, qkv_bias=True, make_vocab_size_divisible_by=8)
    assert LlamaShape.from_model(cfg, vocab=100, make_vocab_size_divisible_by=8) == want
    model = types.SimpleNamespace(config=cfg, vocab_size=128,  # a GPTModel's attributes
                                  share_embeddings_and_output_weights=True)
    got = LlamaShape.from_model(model, vocab=100, make_vocab_size_divisible_by=8)
    assert got == dataclasses.replace(want, tied=True)
    assert LlamaShape.from_model(model).vocab == 128  # the model's (padded) vocabulary
    assert LlamaShape.from_model(_config(num_query_groups=None), vocab=100).num_query_groups == 16
    assert LlamaShape.from_model(_config(qk_layernorm=True), vocab=100).qk_norm


def test_from_model_refuses_with_one_line():
    with pytest.raises(ValueError, match=r"^from_model\(TransformerConfig\) needs vocab=: "):
        LlamaShape.from_model(_config())
    with pytest.raises(ValueError, match=r"^from_model: normalization='LayerNorm' is not a "
                                         r"llama-family decoder"):
        LlamaShape.from_model(_config(normalization="LayerNorm"), vocab=100)
    with pytest.raises(ValueError, match=r"^from_model: gated_linear_unit=False"):
        LlamaShape.from_model(_config(gated_linear_unit=False), vocab=100)
    with pytest.raises(ValueError, match=r"^from_model: dict is not a LlamaSpec, ModelConfig, "):
        LlamaShape.from_model({"hidden_size": 32})


@pytest.mark.parametrize("t,p,tg,pg,want", [(2, 2, 1, 1, "zero_redundancy"),
                                             (2, 2, 2, 2, "zero_redundancy"),
                                             (2, 1, 4, 1, "p2p"), (1, 2, 1, 2, "zero_redundancy"),
                                             (4, 2, 8, 1, "p2p")])
def test_auto_strategy_and_grouping_as_the_trainer(t, p, tg, pg, want):
    layout = TrainLayout(8, tp=t, pp=p)
    gen = gen_placement(layout, SMALL, tg, pg)
    assert gen == default_gen_placement(layout, SMALL, tg, pg)
    assert gen.grouping == ("hybridflow" if want == "zero_redundancy" else "optimal")
    train, specs = train_placement(layout, SMALL), build_specs(SMALL)
    auto = plan_reshard(train, gen, specs, bucket_mb=0.01, itemsize=4)
    named = plan_reshard(train, gen, specs, want, bucket_mb=0.01, itemsize=4)
    assert auto.strategy == want
    assert (auto.buckets, auto.dests, auto.locals) == (named.buckets, named.dests, named.locals)


def test_auto_strategy_is_split_for_disjoint_ranks():
    train, gen = split_placements(TrainLayout(4, tp=2), SMALL, 4, 2)
    assert plan_reshard(train, gen, build_specs(SMALL), "auto").strategy == "split"


def test_train_sources_keeps_the_error_and_needs_a_rank_without_a_group():
    shape = dataclasses.replace(SMALL, vocab=300, make_vocab_size_divisible_by=128)
    layout = TrainLayout(2, tp=2)
    wrong = dataclasses.replace(shape, make_vocab_size_divisible_by=100)
    plan = plan_reshard(train_placement(layout, wrong), gen_placement(layout, wrong, 1),
                        build_specs(wrong), itemsize=4)
    named = megatron_shards(shape, make_hf(shape), 2, 1, 1, 0, 256)
    got = train_sources(plan, 1, named)
    assert got.error == ("training tensor 'embedding.word_embeddings.weight' has shape (256, 32) "
                         "but the reshard's shape description gives (200, 32) (200 = the "
                         "vocabulary's rows per TP rank: check vocab and "
                         "make_vocab_size_divisible_by)")
    assert train_sources(plan, named, rank=1).error == got.error
    with pytest.raises(ValueError, match="^rank= is needed when torch.distributed is not init"):
        train_sources(plan, named)
    right = plan_reshard(train_placement(layout, shape), gen_placement(layout, shape, 1),
                         build_specs(shape), itemsize=4)
    ok = train_sources(right, 1, named)
    assert ok.error is None and set(ok) == {s.key for s in right.specs}
    view, lo = ok["embedding.word_embeddings.weight"]
    assert lo == 256 and torch.equal(view, named["embedding.word_embeddings.weight"][:44])


def test_run_plan_local_reports_a_wrong_training_tensor():
    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan_local
    from hybridrl.reshard.formats import megatron_format

    shape = dataclasses.replace(SMALL, ffn=64)  # the model below has ffn 48
    layout = TrainLayout(2, tp=2)
    gen = gen_placement(layout, shape, 1)
    plan = plan_reshard(train_placement(layout, shape), gen, build_specs(shape), itemsize=4)
    hf = make_hf(SMALL)
    sources = [train_sources(plan, r, megatron_shards(SMALL, hf, 2, r, 1, 0, 56)) for r in (0, 1)]
    asms = [Assembler(plan, r, megatron_format(gen, r)) for r in (0, 1)]
    with pytest.raises(ValueError, match=r"^rank 0: training tensor 'decoder.layers.0.mlp."
                                         r"linear_fc1.weight' has shape \(48, 32\) but the "
                                         r"reshard's shape description gives \(64, 32\)"):
        run_plan_local(plan, sources, asms)
