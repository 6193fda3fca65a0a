"""Shared-prompt packs (``model.share_prompts``): each prompt of a micro-batch computed once.

Pure parts: the layout (``RolloutBatch.microbatch(share=True)``: segments, parents, positions,
the columns each row reads), both attention paths against each response attending its prompt
and itself alone (outputs and gradients), the path choice. Model parts, on one gloo rank: a
llama (GQA, Qwen2's qkv bias, llama3 RoPE scaling) and a Qwen3 shape (q/k norm, head_dim):
actor log-probs and entropy, critic values and every gradient of one backward through the
trainer's losses equal the unshared pack's within 1e-5 (groups with unequal and empty
responses, a group split over two micro-batches, singletons and a one-token prompt mixed in),
on each attention path; models that cannot take the layout fall back.
"""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from hybridrl.models import packing
from hybridrl.rollout.batch import RolloutBatch, gather_response, shared_groups
from hybridrl.testing.dist import run_on_ranks

TOL = 1e-5
R = 8
# rows: group A x3 (one empty response), group B x2, a singleton, group C x4 split over two
# micro-batches, a one-token prompt twice (too short to share: it has no token before its last)
PROMPTS = [[5, 6, 7, 8, 9]] * 3 + [[11, 12, 13]] * 2 + [[21, 22, 23, 24]] + [[31, 32]] * 4 \
    + [[41]] * 2
RESP_LENS = [4, 0, 7, 2, 6, 3, 8, 1, 5, 2, 3, 4]
PARTS = [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11]]


def make_rollout():
    g = torch.Generator().manual_seed(3)
    n = len(PROMPTS)
    resp = torch.randint(3, 100, (n, R), generator=g)
    mask = (torch.arange(R)[None, :] < torch.tensor(RESP_LENS)[:, None]).long()
    rb = RolloutBatch([list(p) for p in PROMPTS], resp * mask, mask, torch.zeros(n, R),
                      list(range(n)), [None] * n, ["x"] * n, [{}] * n)
    tensors = {k: torch.randn(n, R, generator=g) * s for k, s in
               (("advantages", 1.0), ("returns", 1.0), ("values", 0.5))}
    tensors["old_log_probs"] = -torch.rand(n, R, generator=g) * 4 - 1
    tensors["ref_log_probs"] = -torch.rand(n, R, generator=g) * 4 - 1
    return rb, tensors


def test_shared_layout_reads_each_rows_tokens():
    rb, _ = make_rollout()
    assert shared_groups([[1, 2], [1, 2], [3], [3], [1, 2]]) == [[0, 1, 4]]
    mb = rb.microbatch(PARTS[0], packed=True, share=True)
    # prompt A but its last token, then [9, resp] for each of its 3 rows; B likewise
    assert mb["cu_seqlens"].tolist() == [0, 4, 9, 10, 18, 20, 23, 30]
    assert mb["seg_parent"].tolist() == [-1, 0, 0, 0, -1, 4, 4]
    assert mb["position_ids"].tolist() == [0, 1, 2, 3] + [4, 5, 6, 7, 8] + [4] + list(
        range(4, 12)) + [0, 1] + [2, 3, 4] + list(range(2, 9))
    flat = mb["input_ids"][0]
    assert flat[:4].tolist() == [5, 6, 7, 8] and flat[4] == flat[9] == flat[10] == 9
    unshared = rb.microbatch(PARTS[0], packed=True)
    assert mb["input_ids"].shape[1] == 30 < unshared["input_ids"].shape[1] == 40
    assert torch.equal(mb["seq_lens"], unshared["seq_lens"])
    for part in PARTS:  # position t scores token t + 1: both layouts read the same tokens
        sh, un = rb.microbatch(part, share=True, packed=True), rb.microbatch(part, packed=True)
        m = sh["response_mask"].bool()
        nxt = [torch.roll(x["input_ids"], -1, 1) for x in (sh, un)]
        assert torch.equal(gather_response(nxt[0], sh["resp_index"])[m],
                           gather_response(nxt[1], un["resp_index"])[m])
        assert torch.equal(gather_response(nxt[0], sh["resp_index"])[m],
                           rb.response_ids[part][m])
        # every column stays in the row's own segment (masked ones too): prompt last or resp
        seg = torch.repeat_interleave(torch.arange(len(sh["cu_seqlens"]) - 1),
                                      sh["cu_seqlens"].diff().long())
        own = seg[sh["resp_index"]]
        assert torch.equal(own, own[:, :1].expand_as(own))
    assert "seg_parent" not in rb.microbatch([5, 10, 11], share=True, packed=True)  # no group
    assert "seg_parent" not in rb.microbatch(PARTS[0], share=True)  # not packed: padded rows


def _reference(q, k, v, cu, parents, scale):
    """Each segment alone: its parent's keys all, its own causally (one SDPA call each)."""
    b, outs = cu.tolist(), []
    for i, (lo, hi) in enumerate(zip(b[:-1], b[1:])):
        own = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
        keys, vals, mask = k[:, :, lo:hi], v[:, :, lo:hi], own
        if parents[i] >= 0:
            plo, phi = b[parents[i]], b[parents[i] + 1]
            keys = torch.cat([k[:, :, plo:phi], keys], 2)
            vals = torch.cat([v[:, :, plo:phi], vals], 2)
            mask = torch.cat([torch.ones(hi - lo, phi - plo, dtype=torch.bool), own], 1)
        outs.append(F.scaled_dot_product_attention(q[:, :, lo:hi], keys, vals, attn_mask=mask,
                                                   scale=scale, enable_gqa=True))
    return torch.cat(outs, 2)


@pytest.mark.parametrize("lens,parents", [
    ([5, 4, 3, 1, 6, 2, 3, 2, 2], [-1, -1, 1, 1, 1, -1, -1, 6, 6]),
    ([3, 1, 1], [-1, 0, 0]), ([40, 7, 30, 2], [-1, 0, 0, 0]),
])
def test_shared_attention_paths_equal_each_response_alone(lens, parents):
    torch.manual_seed(0)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    S = int(cu[-1])
    qkv = [torch.randn(1, h, S, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    weight = torch.randn(1, 4, S, 8, dtype=torch.float64)
    ref = _reference(*qkv, cu, parents, 0.3)
    want = torch.autograd.grad((ref * weight).sum(), qkv)
    for path in ("mask", "grouped"):
        out = packing.shared_attention(*qkv, cu, parents, 0.3, path=path)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
        for got, expect in zip(torch.autograd.grad((out * weight).sum(), qkv), want):
            torch.testing.assert_close(got, expect, atol=1e-12, rtol=0)
    with pytest.raises(ValueError):
        packing.shared_attention(*qkv, cu, parents, 0.3, path="loop")


def test_shared_path_choice():
    cu = lambda lens: torch.tensor([0] + lens).cumsum(0).to(torch.int32)  # noqa: E731
    assert packing.shared_path(cu([21, 29, 30, 25, 29]), [-1, 0, 0, 0, 0]) == "mask"  # small
    big = [1023] + [600] * 16  # a 1k prompt, 16 responses: one mask would be [10.6k]^2
    assert packing.shared_path(cu(big), [-1] + [0] * 16) == "grouped"
    mask = packing.shared_block_mask(cu([2, 1, 2]), [-1, 0, 0])
    assert mask.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                                   [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]


SHAPES = {
    "llama": dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, vocab_size=100, max_position_embeddings=64,
                  qkv_bias=True, architecture="Qwen2ForCausalLM"),
    "llama_rope_scaled": dict(hidden_size=32, num_layers=2, num_attention_heads=4,
                              num_query_groups=1, ffn_hidden_size=48, vocab_size=100,
                              max_position_embeddings=64, rope="llama3"),
    "qwen3": dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, vocab_size=100, max_position_embeddings=64,
                  architecture="Qwen3ForCausalLM", qk_norm=True, head_dim=16),
}


def _spec(shape, **extra):
    from hybridrl.models.spec import LlamaSpec, RopeScaling

    if shape == "qwen3_moe":
        return LlamaSpec(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=48, vocab_size=100, max_position_embeddings=64,
                         architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4,
                         moe_topk=2, moe_ffn_hidden_size=16, **extra)
    kw = dict(SHAPES[shape])
    if kw.pop("rope", None):
        kw["rope_scaling"] = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0,
                                         original_max_position_embeddings=16)
    return LlamaSpec(**kw)


def _run_mode(groups, spec, share: bool, path: str | None):
    from hybridrl.algos.agg import compute_agg_normalizers
    from hybridrl.config.roles import ActorConfig, CriticConfig
    from hybridrl.models.build import DDPOptions, build_model
    from hybridrl.models.forward import run_microbatches, shares_prompts
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step
    from hybridrl.trainer.updates import actor_loss_fn, critic_loss_fn

    rb, tensors = make_rollout()
    mbs = [rb.microbatch(p, tensors, packed=True, share=share) for p in PARTS]
    norm = compute_agg_normalizers([mb["response_mask"] for mb in mbs], None,
                                   loss_scale_factor=R)
    actor_cfg = dataclasses.replace(ActorConfig(), entropy_coeff=0.01, use_kl_loss=True)
    out = {}
    saved = packing.shared_path
    if path is not None:  # every layer takes this path
        packing.shared_path = lambda cu, parents: path  # noqa: E731
    try:
        for role, keys, loss in (
                ("actor", ("logprobs", "entropy"), functools.partial(actor_loss_fn, actor_cfg,
                                                                     False)),
                ("critic", ("values",), functools.partial(critic_loss_fn, CriticConfig()))):
            model = build_model(spec, groups, role, seed=5,
                                ddp_options=DDPOptions(use_distributed_optimizer=False))
            with torch.no_grad():
                for p in model.module.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            assert shares_prompts(model)
            res = run_microbatches(model, mbs, with_entropy=True)
            for key in keys:
                out[key] = torch.cat([gather_response(o[key], mb["resp_index"]) * mb[
                    "response_mask"] for o, mb in zip(res, mbs)])
            opt = ModelOptimizer(model, OptimConfig(lr=1e-3, grad_clip=0.0))
            metrics = train_step(model, opt, mbs, functools.partial(loss, norm=norm,
                                                                     k=len(mbs)))
            out[f"{role}_loss"] = torch.tensor(metrics["loss"])
            out[f"{role}_grads"] = torch.cat([p.main_grad.flatten()
                                              for p in model.module.parameters()])
    finally:
        packing.shared_path = saved
    return out


def _model_cases(rank, world):
    import warnings

    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    warnings.filterwarnings("ignore")
    groups = build_groups(TrainLayout(world=1, tp=1, pp=1))
    results = {}
    for shape in SHAPES:
        spec = _spec(shape)
        torch.manual_seed(0)
        base = _run_mode(groups, spec, False, None)
        for path in ("mask", "grouped"):
            torch.manual_seed(0)
            got = _run_mode(groups, spec, True, path)
            results[(shape, path)] = {k: (float((got[k] - base[k]).abs().max()),
                                          float(base[k].abs().max())) for k in base}
    results["fallback"] = _fallback(groups)
    return results


def _fallback(groups):
    """A model whose layers run megatron's own attention (full recompute): the trainer's
    switch turns sharing off with one warning, and a shared pack handed to it is one
    ValueError line."""
    import types

    from hybridrl.models.build import build_model
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.local_spec import LeanSelfAttention
    from hybridrl.trainer.microbatches import share_prompts

    model = build_model(_spec("llama"), groups, "actor", seed=5, recompute_granularity="full",
                        recompute_method="uniform", recompute_num_layers=1)
    on = types.SimpleNamespace(pack_sequences=True, share_prompts=True)
    rb, _ = make_rollout()
    try:
        run_microbatches(model, [rb.microbatch(PARTS[0], packed=True, share=True)])
        refused = ""
    except ValueError as err:
        refused = str(err)
    able = share_prompts(on, model)
    # a shared pack never falls through to megatron's forward (its THD RoPE restarts at every
    # segment): a lean layer given an input only megatron runs refuses it in one line
    lean = build_model(_spec("llama"), groups, "actor", seed=5)
    layer = next(m for m in lean.module.modules() if isinstance(m, LeanSelfAttention))
    params = packing.packed_seq_params(torch.tensor([0, 3, 5], dtype=torch.int32))
    packing.pack_cached(params, "parents", lambda: [-1, 0])
    try:
        layer(torch.zeros(5, 1, 32), None, attention_bias=torch.zeros(1), packed_seq_params=params)
        megatron_only = ""
    except ValueError as err:
        megatron_only = str(err)
    # a MoE whose load-balancing loss is a mean over the micro-batch's tokens does not share
    moe = {coef: share_prompts(on, build_model(_spec("qwen3_moe", moe_aux_loss_coef=coef), groups,
                                               "actor", seed=5))
           for coef in (0.0, 0.1)}
    return {"able": able, "again": share_prompts(on, model), "refused": refused,
            "megatron_only": megatron_only, "moe": moe}


@pytest.fixture(scope="module")
def model_results():
    return run_on_ranks(_model_cases, 1, timeout=300, preload=("megatron.core",))[0]


def test_a_model_that_cannot_share_falls_back(model_results):
    res = model_results["fallback"]
    assert res["able"] is False and res["again"] is False
    assert "shared-prompt pack needs the local spec's lean attention" in res["refused"]
    assert "\n" not in res["refused"]
    assert "only megatron's forward runs" in res["megatron_only"], res["megatron_only"]
    assert res["moe"] == {0.0: True, 0.1: False}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("path", ["mask", "grouped"])
def test_shared_pack_equals_unshared_pack(model_results, shape, path):
    for key, (diff, scale) in model_results[(shape, path)].items():
        assert diff <= TOL, (key, diff, scale)
        assert scale > 1e-3, (key, scale)  # real numbers, not zeros


def test_token_tally_reports_the_shared_fraction():
    from hybridrl.trainer.microbatches import TokenTally

    rb, _ = make_rollout()
    tally = TokenTally()
    with tally.count([rb.microbatch(PARTS[0], packed=True, share=True)]):  # 30 of 40 tokens
        pass
    m = tally.pop_metrics()
    assert m["perf/shared_prompt_frac"] == pytest.approx(1 - 30 / 40)
    assert m["perf/pad_fraction"] == 0.0
    with tally.count([rb.microbatch(PARTS[0], packed=True)]):
        pass
    assert tally.pop_metrics()["perf/shared_prompt_frac"] == 0.0


def test_token_budget_plan_keeps_prompt_groups_in_one_pack():
    import random

    from hybridrl.data.batching import plan_dp_micro_batches, plan_micro_batches
    from hybridrl.trainer.microbatches import forward_parts

    rng = random.Random(0)
    lens = [rng.randint(20, 90) for _ in range(32)]  # 8 groups of 4 consecutive rows
    groups = [i // 4 for i in range(32)]
    plan = plan_micro_batches(lens, 400, packed=True, groups=groups).micro_batches
    assert sorted(i for p in plan for i in p) == list(range(32))
    assert all(sum(lens[i] for i in p) <= 400 for p in plan)
    assert all(len({groups[i] for i in p}) * 4 == len(p) for p in plan)  # whole groups only
    rows = plan_micro_batches(lens, 400, packed=True).micro_batches  # by rows: groups split
    assert any(len({groups[i] for i in p}) * 4 != len(p) for p in rows)
    # a group over the budget: consecutive chunks that fit; too few groups for the count: rows
    big = plan_micro_batches([60] * 8, 130, packed=True, groups=[0] * 8).micro_batches
    assert sorted(map(sorted, big)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert len(plan_micro_batches([10] * 4, 400, 4, packed=True, groups=[0] * 4)
               .micro_batches) == 4
    dp = plan_dp_micro_batches(lens, 2, 400, packed=True, groups=groups,
                               partition=[list(range(16)), list(range(16, 32))])
    assert all(len({groups[i] for i in p}) * 4 == len(p) for r in dp for p in r.micro_batches)
    parts = forward_parts(lens, 4, True, 400, True, groups=groups)
    assert all(len({groups[i] for i in p}) * 4 == len(p) for p in parts)


def test_grouped_mask_on_cuda_is_the_same_bottom_right_causal_mask():
    # on CUDA the grouped path passes torch's causal_lower_right bias (flash kernel with GQA,
    # nothing materialized) instead of the plan's bool mask: the two must be the same mask

    cu = torch.tensor([0, 4, 7, 9, 14, 15, 17])
    plan = packing.shared_plan(cu, [-1, 0, 0, 0, -1, 4])
    assert plan["groups"]
    for g in plan["groups"]:
        bias = packing.group_mask(g, torch.device("cuda"))
        assert torch.equal(bias._materialize(), g["mask"]), g
        assert packing.group_mask(g, torch.device("cpu")) is g["mask"]
