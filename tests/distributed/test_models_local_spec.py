"""hybridrl's lean local layer spec (hybridrl/models/local_spec.py) vs megatron's own local spec.

On 1 and 2 gloo ranks (tp = world), the same seed builds the same weights with both specs; then:
- logits of the whole GPTModel (2e-6) and the gradients of every parameter (DDP ``main_grad``;
  2e-6 of each gradient's largest entry) agree in fp32 (train mode, GQA 4 heads / 2 groups,
  RoPE): float rounding, not semantics;
- in bf16 the lean model is no further from the fp32 model than megatron's bf16 model is;
- a frozen reference model (``linear_with_frozen_weight`` in megatron) gives the same logits;
- Qwen3's q/k norms (head_dim 32 != hidden/heads) run in the lean forward with the same numbers;
- a config the lean forwards do not cover (interleaved RoPE) falls back to megatron's forward;
- ``SDPACoreAttention`` equals megatron's ``DotProductAttention`` with an explicit padding mask
  and at sq = 1, and refuses sliding windows.
tests/distributed/test_models.py checks the lean model against transformers.
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks

SPEC = dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=96, vocab_size=100, max_position_embeddings=64)
B, T = 3, 11


def _build(groups, lean: bool, role="actor", dtype="fp32", qk_norm=False, **overrides):
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from hybridrl.models import build
    from hybridrl.models.local_spec import local_layer_spec
    from hybridrl.models.spec import LlamaSpec

    build.layer_spec = (lambda use_te, qk_norm=False: local_layer_spec(qk_norm)) if lean else (
        lambda use_te, qk_norm=False: gpt_layer_specs.get_gpt_layer_local_spec(
            normalization="RMSNorm", qk_layernorm=qk_norm))
    spec = LlamaSpec(**SPEC, **({"qk_norm": True, "architecture": "Qwen3ForCausalLM",
                                  "head_dim": 32} if qk_norm else {}))
    model = build.build_model(spec, groups, role, dtype=dtype, seed=3, **overrides)
    if not lean:  # megatron's own output layer too
        model.module.output_layer.__class__ = ColumnParallelLinear
    return model


def _run(model, ids, weight_BTV):
    """Logits and, for a trainable model, every parameter's gradient of sum(logits * w)."""
    pos = torch.arange(T).expand(B, T)
    logits = model.module(ids, pos, None)  # [B, T, V/tp]
    grads = {}
    if model.ddp is not None:
        model.ddp.zero_grad_buffer()
        (logits.float() * weight_BTV[..., :logits.shape[-1]]).sum().backward()
        grads = {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}
    return logits.detach().float(), grads


def _max_diff(a: dict, b: dict) -> float:
    """Largest difference of two gradient sets, relative to each gradient's largest entry."""
    assert a.keys() == b.keys()
    return max((float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30))
                for k in a), default=0.0)


def _attention_cases():
    """SDPACoreAttention vs DotProductAttention on random q/k/v (one rank's heads)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from hybridrl.models.local_spec import SDPACoreAttention
    from hybridrl.models.spec import LlamaSpec, to_transformer_config

    model = _build(_rank_groups(), lean=True)
    config, pgc = model.config, model.pg_collection
    heads = SPEC["num_attention_heads"] // model.groups.tp_size
    groups = SPEC["num_query_groups"] // model.groups.tp_size
    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
              attention_type="self", pg_collection=pgc)
    ours, theirs = SDPACoreAttention(**kw), DotProductAttention(**kw)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(T, B, heads, 16, generator=g)
    k, v = torch.randn(T, B, groups, 16, generator=g), torch.randn(T, B, groups, 16, generator=g)
    mask = torch.rand(B, 1, T, T, generator=g) > 0.6  # True = masked out
    mask[..., 0] = False  # every query sees at least one key
    out = {"mask": float((ours(q, k, v, mask) - theirs(q, k, v, mask)).abs().max())}
    q1 = q[:1]
    out["sq1"] = float((ours(q1, k[:1], v[:1], None) - theirs(q1, k[:1], v[:1], None)).abs().max())
    out["causal"] = float((ours(q, k, v, None) - theirs(q, k, v, None)).abs().max())
    spec = LlamaSpec(**SPEC)
    windowed = to_transformer_config(spec, model.groups.train, window_size=(4, 0))
    try:
        SDPACoreAttention(**{**kw, "config": windowed})
        out["window_error"] = ""
    except ValueError as err:
        out["window_error"] = str(err)
    return out


def _rank_groups():
    import torch.distributed as dist

    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    world = dist.get_world_size()
    return build_groups(TrainLayout(world=world, tp=world, pp=1))


def _rank(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    groups = _rank_groups()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SPEC["vocab_size"], (B, T), generator=g)
    weight = torch.randn(B, T, 256, generator=g)
    vocab = slice(groups.tp_rank * 128, (groups.tp_rank + 1) * 128)  # padded 128 per rank
    weight = weight[..., vocab]
    res = {}
    models = {lean: _build(groups, lean) for lean in (False, True)}
    params = [dict(models[lean].module.named_parameters()) for lean in (False, True)]
    res["same_weights"] = (params[0].keys() == params[1].keys()
                           and all(torch.equal(params[0][k], params[1][k]) for k in params[0]))
    (lm, gm), (ll, gl) = (_run(models[lean], ids, weight) for lean in (False, True))
    res["fp32_logits"], res["fp32_grads"] = float((lm - ll).abs().max()), _max_diff(gm, gl)
    res["lean_output_layer"] = models[True].module.output_layer.lean
    res["megatron_output_layer"] = type(models[False].module.output_layer).__name__
    res["lean_flags"] = sorted({type(m).__name__ for m in models[True].module.modules()
                                if getattr(m, "lean", False)})
    ref32 = lm
    for lean in (False, True):
        bf = _build(groups, lean, dtype="bf16")
        res[f"bf16_err_{lean}"] = float((_run(bf, ids, weight)[0] - ref32).abs().max())
    frozen = {lean: _build(groups, lean, role="reference") for lean in (False, True)}
    res["frozen_logits"] = float((_run(frozen[False], ids, weight)[0]
                                  - _run(frozen[True], ids, weight)[0]).abs().max())
    inter = {lean: _build(groups, lean, rotary_interleaved=True) for lean in (False, True)}
    res["fallback_lean"] = [m.lean for m in inter[True].module.modules()
                            if type(m).__name__ == "LeanSelfAttention"]
    (li, gi), (ll2, gl2) = (_run(inter[lean], ids, weight) for lean in (False, True))
    res["fallback_logits"], res["fallback_grads"] = float((li - ll2).abs().max()), _max_diff(gi, gl2)
    qk = {lean: _build(groups, lean, qk_norm=True) for lean in (False, True)}
    res["qk_norm_lean"] = [m.lean for m in qk[True].module.modules()
                           if type(m).__name__ == "LeanSelfAttention"]
    (lq, gq), (ll3, gl3) = (_run(qk[lean], ids, weight) for lean in (False, True))
    res["qk_norm_logits"], res["qk_norm_grads"] = float((lq - ll3).abs().max()), _max_diff(gq, gl3)
    res.update(_attention_cases())
    return res


@pytest.fixture(scope="module")
def results():
    return {world: run_on_ranks(_rank, world, timeout=300, preload=("megatron.core",))
            for world in (1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_lean_spec_equals_megatron_local_spec(results, world):
    for r in results[world]:
        assert r["same_weights"]
        assert r["lean_flags"] == ["LeanColumnParallelLinear", "LeanMLP", "LeanRowParallelLinear",
                                   "LeanSelfAttention", "LeanTransformerLayer"]
        assert r["lean_output_layer"] and r["megatron_output_layer"] == "ColumnParallelLinear"
        assert r["fp32_logits"] < 2e-6 and r["fp32_grads"] < 2e-6, r
        assert r["frozen_logits"] < 2e-6, r
        # bf16: no further from the fp32 model than megatron's own bf16 model (plus slack)
        assert r["bf16_err_True"] <= 1.5 * r["bf16_err_False"] + 1e-2, r


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_qk_norm_lean_equals_megatron(results, world):
    """Qwen3's per-head q/k RMSNorm (head_dim 32 != hidden/heads) runs in the lean forward."""
    for r in results[world]:
        assert r["qk_norm_lean"] and all(r["qk_norm_lean"])
        assert r["qk_norm_logits"] < 2e-6 and r["qk_norm_grads"] < 2e-6, r


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_uncovered_config_falls_back_to_megatron(results, world):
    for r in results[world]:
        assert r["fallback_lean"] and not any(r["fallback_lean"])
        assert r["fallback_logits"] < 2e-6 and r["fallback_grads"] < 2e-6, r


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_sdpa_core_attention_equals_dot_product_attention(results, world):
    for r in results[world]:
        assert r["mask"] < 1e-6 and r["sq1"] < 1e-6 and r["causal"] < 1e-6, r
        assert "window_size" in r["window_error"]
