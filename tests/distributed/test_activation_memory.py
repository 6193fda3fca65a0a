"""Activation-memory knobs (hybridrl.models.activation) on 4 gloo ranks at (tp, pp) = (2, 2).

Each knob that runs on CPU (full recompute uniform/block, selective recompute) must give the same
micro-batch losses and fp32 gradients as the run without it, and must really recompute: the
layers (full) or core attentions (selective) run their forward twice per training micro-batch.
Knobs megatron cannot honour here fail before any weight is read, naming the key.
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks

KNOBS = {
    "base": {},
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective"),
}


def _count_calls(modules) -> list[int]:
    counter = [0]

    def hook(*_):
        counter[0] += 1

    for sub in modules:
        sub.register_forward_hook(hook)
    return counter


def _run(groups, knobs: dict) -> dict:
    from hybridrl.config.model import ModelConfig
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.hf_io import build_from_config

    model = build_from_config(ModelConfig(**knobs), groups, "actor", seed=3)
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [m for m in model.module.modules() if isinstance(m, TransformerLayer)]
    layer_calls = _count_calls(layers)
    attention = _count_calls([layer.self_attention.core_attention for layer in layers])  # SDPA
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0))

    def loss_fn(outputs, batch):
        loss = -outputs["logprobs"].mean() - 0.01 * outputs["entropy"].mean()
        return loss, {}

    model.ddp.zero_grad_buffer()
    res = run_microbatches(model, [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}], loss_fn,
                           forward_only=False)
    return {"losses": [float(r["loss"]) for r in res],
            "grads": [p.main_grad.clone() for p in model.module.parameters()],
            "layer_calls": layer_calls[0], "attention_calls": attention[0]}


def _errors(groups) -> dict:
    from hybridrl.config.model import ModelConfig
    from hybridrl.models.hf_io import build_from_config

    out = {}
    for name, knobs in (("too_many_layers", dict(recompute_granularity="full",
                                                 recompute_num_layers=3)),):
        try:
            build_from_config(ModelConfig(**knobs), groups, "actor")
        except ValueError as err:
            out[name] = str(err)
        else:
            out[name] = None
    return out


def rank_main(rank: int, world: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    groups = build_groups(TrainLayout(world=world, tp=2, pp=2))
    out = {name: _run(groups, knobs) for name, knobs in KNOBS.items()}
    out["errors"] = _errors(groups)
    out["last_stage"] = groups.is_last_stage
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(rank_main, 4, timeout=300, preload=("megatron.core",))


@pytest.mark.slow
@pytest.mark.parametrize("knob", ["full_uniform", "full_block", "selective"])
def test_knob_keeps_losses_and_gradients(results, knob):
    for rank in results:
        base, other = rank["base"], rank[knob]
        assert other["losses"] == pytest.approx(base["losses"], abs=1e-6)
        assert len(other["grads"]) == len(base["grads"])
        for a, b in zip(base["grads"], other["grads"]):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_knobs_really_recompute(results):
    for rank in results:
        base = rank["base"]
        assert base["layer_calls"] > 0 and base["attention_calls"] > 0
        for knob in ("full_uniform", "full_block"):  # every layer of the stage (block: 2 of 2)
            assert rank[knob]["layer_calls"] == 2 * base["layer_calls"], knob
        assert rank["selective"]["layer_calls"] == base["layer_calls"]
        assert rank["selective"]["attention_calls"] == 2 * base["attention_calls"]


@pytest.mark.slow
def test_knobs_megatron_cannot_honour_fail_first(results):
    errors = results[0]["errors"]
    assert "model.recompute_num_layers" in errors["too_many_layers"]
    assert "[1, 2]" in errors["too_many_layers"]
