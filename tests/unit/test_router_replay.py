"""Routing replay (issue 38 item 5) on a megatron-core MoE GPTModel (SequentialMLP, alltoall
dispatcher, ep 1, one gloo rank) against the builtin engine fed by the reshard.

The engine generates with the model's weights and records its top-k expert ids. Then, in the
trainer's model, router rows of experts the rollout never chose are overwritten with twice a
chosen expert's row (the engine's choices keep their gating logits; the trainer's own routing
now prefers the new experts). Checks:
- unperturbed, the trainer's own routing agrees with the engine's on every (token, layer)
  (agreement 1.0: the ids are aligned token by token), padded and packed micro-batches;
- perturbed, without replay the response log-probs are far from the engine's; with
  ``routed_experts`` in the micro-batch they equal the engine's within fp32 rounding, and the
  agreement is below 1;
- ``megatron_order`` (pure): sequence-first order, packs, sequence-parallel chunks.
"""

from __future__ import annotations

import torch

from hybridrl.models.router_replay import megatron_order
from hybridrl.testing.dist import run_on_ranks

E, K = 32, 2
PROMPTS = [[5, 17, 42], [7, 1, 9]]  # 2 x (3 + 4 - 1) tokens x 2 < 32: experts stay unchosen


def _model_and_engine():
    from hybridrl.models.build import build_model
    from hybridrl.models.spec import LlamaSpec
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.placement import gen_placement, train_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import LlamaShape, build_specs
    from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec
    from hybridrl.rollout.engine_sync import sync_engine

    layout = TrainLayout(world=1, tp=1, pp=1)
    spec = LlamaSpec(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=48, vocab_size=100, max_position_embeddings=64,
                     architecture="Qwen3MoeForCausalLM", qk_norm=True, head_dim=8,
                     num_experts=E, moe_topk=K, moe_ffn_hidden_size=16)
    model = build_model(spec, build_groups(layout), "actor", seed=5)
    with torch.no_grad():  # weights well away from their init scale: routing is decisive
        for p in model.module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    shape = LlamaShape.from_model(spec)
    train = train_placement(layout, shape)
    gen = gen_placement(layout, shape, 1)
    plan = plan_reshard(train, gen, build_specs(shape), itemsize=4)
    engine = BuiltinEngine(EngineSpec.from_llama(spec, gen.vocab_chunk))
    named = {n: p.detach() for n, p in model.module.named_parameters()}
    sync_engine(plan, 0, shape, named, engine, torch.float32)
    return model, engine


def _batch(out):
    from hybridrl.rollout.batch import RolloutBatch

    n = len(PROMPTS)
    return RolloutBatch(PROMPTS, out.response_ids, out.response_mask, out.logprobs,
                        list(range(n)), [None] * n, ["t"] * n, [{}] * n,
                        routed_experts=out.routed_experts)


def _logprobs(model, rb, replay: bool, packed: bool):
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.router_replay import pop_agreement
    from hybridrl.rollout.batch import gather_response

    tensors = {"routed_experts": rb.routed_experts} if replay else None
    mb = rb.microbatch(list(range(len(rb))), tensors, packed=packed)
    out = run_microbatches(model, [mb], with_entropy=False)[0]
    logp = gather_response(out["logprobs"], mb["resp_index"]) * rb.response_mask
    return logp, pop_agreement(model.module)


def _case(rank, world):
    from hybridrl.rollout.base import SamplingParams

    torch.manual_seed(0)
    model, engine = _model_and_engine()
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0, seed=3))
    rb = _batch(out)
    res = {"lens": out.response_mask.sum(-1).tolist()}
    for packed in (False, True):
        _, res[f"agree_clean_{packed}"] = _logprobs(model, rb, True, packed)
    routers = [m for m in model.module.modules() if hasattr(m, "router_replay")]
    with torch.no_grad():
        for L, router in enumerate(routers):
            chosen = out.routed_experts[:, :, L][out.routed_experts[:, :, L] >= 0].long()
            counts = torch.bincount(chosen, minlength=E)
            unchosen = torch.nonzero(counts == 0).flatten()
            res[f"unchosen_{L}"] = len(unchosen)
            router.weight[unchosen] = 2 * router.weight[int(counts.argmax())]
    for packed in (False, True):
        free, _ = _logprobs(model, rb, False, packed)
        replayed, agree = _logprobs(model, rb, True, packed)
        res[f"free_{packed}"] = float((free - out.logprobs).abs().max())
        res[f"replay_{packed}"] = float((replayed - out.logprobs).abs().max())
        res[f"agree_{packed}"] = agree
    return res


def test_replay_reproduces_engine_logprobs_when_router_weights_differ():
    res = run_on_ranks(_case, 1)[0]
    assert res["unchosen_0"] > 0 and res["unchosen_1"] > 0, res  # the setup's premise
    for packed in (False, True):
        agree, counted = res[f"agree_clean_{packed}"]
        assert counted == 2 * sum(3 + n - 1 for n in res["lens"]) and agree == counted, res
        assert res[f"replay_{packed}"] < 1e-4, res
        assert res[f"free_{packed}"] > 1e-2, res
        agree, counted = res[f"agree_{packed}"]
        assert 0 < agree < counted, res


def test_megatron_order_layouts():
    # row i, token t, layer L, slot j -> 1000 i + 10 t + j (layer 1 adds 500)
    b, W, k = 2, 4, 2
    ids = torch.tensor([[[[1000 * i + 10 * t + j + 500 * L for j in range(k)] for L in range(2)]
                         for t in range(W)] for i in range(b)])
    got = megatron_order(ids, 5, 1)  # [T, b] sequence-first, T past W filled with -1
    assert got.shape == (10, k)
    assert got[1].tolist() == [1500, 1501] and got[2].tolist() == [510, 511]
    assert (got[8:] == -1).all()
    sp = megatron_order(ids, 4, 0, sp_rank=1, sp_size=2)  # sequence chunk 2 of 2: t = 2, 3
    assert sp[:, 0].tolist() == [20, 1020, 30, 1030]
    pack = megatron_order(ids, 8, 0, cu_seqlens=torch.tensor([0, 3, 7]))
    assert pack[:, 0].tolist() == [0, 10, 20, 1000, 1010, 1020, 1030, -1]


def test_router_replay_knob_and_a_batch_without_ids():
    import types

    import pytest

    from hybridrl.config.roles import ActorConfig
    from hybridrl.rollout.batch import RolloutBatch
    from hybridrl.trainer.updates import ppo_updates

    with pytest.raises(ValueError, match="actor.router_replay"):
        ActorConfig(router_replay="engine")
    rb = RolloutBatch([[1, 2]], torch.tensor([[3]]), torch.tensor([[1]]), torch.zeros(1, 1),
                      [0], [None], ["t"], [{}])
    with pytest.raises(ValueError, match="router_replay=rollout: the rollout batch carries no"):
        ppo_updates(None, None, ActorConfig(router_replay="rollout"), rb, {}, None, "actor",
                    partition=([[0]], [3]), groups=types.SimpleNamespace(dp_size=1), n=1,
                    loss_scale=1, temperature=1.0)
