"""A mixture-of-experts model behind the SGLang adapter, in this one process (SGLang 0.5.21's
real modules through the test-only prelude): the engine starts with the custom loader
registered as SGLang's real ``ServerArgs`` and its runner-side ``WeightUpdater`` resolve it
(the user's own loaders kept), dense models start exactly as before, engine keywords that move
the experts are one line, and the per-rank table of a MoE model needs no dense MLP split.
The push itself, through the adapter into SGLang's real Qwen3-MoE at gen tp 1/2/4:
tests/distributed/test_moe_reshard_sglang.py.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from hybridrl.config.rollout import RolloutConfig
from hybridrl.rollout.sglang.adapter import build_sglang_engine, engine_start_kwargs
from hybridrl.rollout.sglang.env import scoped_torch_reductions
from hybridrl.rollout.sglang.layout import engine_param_shapes
from hybridrl.rollout.sglang.loader import LOADER
from tests.unit.test_moe_reshard import MOE


@pytest.fixture(scope="module")
def real():
    from tests.support.sglang_prelude import import_real_modules

    return import_real_modules()


def _kwargs(moe: bool, **engine_kwargs):
    return engine_start_kwargs("hf/", tp_size=2, base=0, step=1, dtype=torch.float32, moe=moe,
                               rollout=RolloutConfig(engine="sglang", engine_kwargs=engine_kwargs))


def _push(real, loaders: list, tensor: torch.Tensor, load_format: str):
    """SGLang's runner-side updater (as ModelRunner.init_weight_updater builds it, its loaders
    from the published config) loading one tensor into a one-parameter model."""
    model = torch.nn.Module()
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    root = torch.nn.Module()
    root.model = model
    updater = real["runner_weight_updater"].WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders=loaders,
        get_model=lambda: root, update_model_fields=lambda **kw: None,
        recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
    with scoped_torch_reductions(lambda: None):  # the updater patches torch's reductions
        result = updater.update_weights_from_tensor([("model.norm.weight", tensor)],
                                                    load_format=load_format)
    return result, model.norm.weight


def test_moe_engine_registers_the_loader_sglang_resolves(real, tmp_path):
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
                   num_experts=8, num_hidden_layers=1, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=4, vocab_size=60).save_pretrained(tmp_path)
    mine = "tests.unit.test_moe_reshard.make_moe_hf"  # a user's own loader stays registered
    kwargs = _kwargs(True, custom_weight_loader=[mine])
    kwargs["model_path"] = str(tmp_path)
    from sglang.srt.runtime_context import get_model, reset_context

    from tests.support.sglang_real import publish

    args = publish(kwargs)  # as a scheduler publishes its engine's ServerArgs
    try:
        assert args.custom_weight_loader == [mine, LOADER]
        assert args.moe_runner_backend == "triton"  # keeps FusedMoE's checkpoint layout
        x = torch.arange(4.0)
        (ok, _), weight = _push(real, get_model().custom_weight_loader, x, LOADER)
        assert ok and torch.equal(weight, x)  # SGLang imported and ran the loader by its name
        with pytest.raises(NotImplementedError, match="Unknown load_format"):
            _push(real, [], x, LOADER)  # an engine started without it cannot take the push
    finally:
        reset_context()  # nothing else in this process runs with a published config
    dense = _kwargs(False)
    assert "custom_weight_loader" not in dense and "moe_runner_backend" not in dense


@pytest.mark.parametrize("key,value", [("ep_size", 2), ("moe_dp_size", 2),
                                       ("moe_runner_backend", "flashinfer_trtllm")])
def test_engine_kwargs_that_move_the_experts_are_one_line(key, value):
    rollout = types.SimpleNamespace(engine_kwargs={key: value}, engine_start_timeout_s=1.0,
                                    engine_port_base=30000, timeout_s=1.0)
    with pytest.raises(ValueError, match=f"rollout.engine_kwargs sets {key}={value!r}: a "
                                         "mixture-of-experts model"):
        build_sglang_engine("m", shape=MOE, all_members=[[0]], rank=0, device="cpu",
                            dtype=torch.float32, rollout=rollout)


def test_moe_table_has_experts_and_no_dense_mlp():
    shape = dataclasses.replace(MOE, ffn=25)  # the dense width is not split for MoE
    table = engine_param_shapes(shape, 2)
    assert table["model.layers.1.mlp.experts.7.gate_up_proj.weight"] == (12, 16)
    assert table["model.layers.1.mlp.experts.7.down_proj.weight"] == (16, 6)
    assert table["model.layers.1.mlp.gate.weight"] == (8, 16)
    assert not [n for n in table if ".mlp.gate_up_proj" in n or ".mlp.down_proj" in n]
