"""SGLang 0.5.21's real Qwen3MoeForCausalLM on CPU (4 gloo ranks, one launch; the test-only
prelude lets its modules import), at gen tp 1, 2 and 4, against the same model after SGLang's
own ``load_weights`` on the full HF tensors (per-expert checkpoint names); every parameter must
be bitwise equal:
- the reshard from megatron training shards (tp 2, ep 2, expert tp 1; the oracle of
  tests/unit/test_moe_reshard.py) in the engine format, loaded per rank by
  ``hybridrl.rollout.sglang.loader.load_direct``; the per-rank shapes equal
  ``engine_param_shapes``;
- the colocated adapter path, as the rollout worker runs it: ``build_sglang_engine`` (SGLang's
  real backend: serializer, request class) starts an in-process engine
  (tests/support/sglang_real.py) whose ``ServerArgs`` every member's scheduler adopts, as
  SGLang's schedulers get the engine's, so SGLang's real runner ``WeightUpdater`` knows the
  custom loaders the adapter registered; ``sync_engine`` pushes the shards through the
  scheduler-side updater with sessions. Each request names ``loader.LOADER`` as its
  load_format;
- the split placement's path, once (training ranks 0-1 at tp 1, ep 2 send over the bridge;
  ranks 2-3 are one gen tp 2 replica: ``build_split_engine`` + ``receive_weights``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks

WORLD = 4


def _hf_config(shape):
    import transformers

    return transformers.Qwen3MoeConfig(
        hidden_size=shape.hidden, intermediate_size=shape.ffn,
        moe_intermediate_size=shape.moe_ffn_hidden_size, num_experts=shape.num_experts,
        num_experts_per_tok=shape.moe_topk, norm_topk_prob=True, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.num_query_groups,
        head_dim=shape.head_dim, vocab_size=shape.vocab, tie_word_embeddings=False,
        torch_dtype="float32")


def _tp_coordinator(tg: int, tag: str = ""):
    """tests/support/sglang_real.tp_coordinator plus SGLang's MoE widths and ranks at ep 1
    (moe_tp = tp), published in the same override (SGLang validates them together)."""
    import torch.distributed as dist
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    world = dist.get_world_size()
    opts = dict(use_pynccl=False, use_custom_allreduce=False)
    tp = ps.init_model_parallel_group([list(range(i, i + tg)) for i in range(0, world, tg)], 0,
                                      "gloo", group_name=f"moe_tp{tg}{tag}", **opts)
    pp = ps.init_model_parallel_group([[r] for r in range(world)], 0, "gloo",
                                      group_name=f"moe_pp{tg}{tag}", **opts)
    r = tp.rank_in_group
    get_parallel().override_permanently(
        tp_size=tg, tp_rank=r, pp_size=1, pp_rank=0, attn_tp_size=tg, attn_tp_rank=r,
        attn_dp_size=1, attn_dp_rank=0, attn_cp_size=1, attn_cp_rank=0, tp_group=tp,
        pp_group=pp, attn_tp_group=tp, moe_ep_size=1, moe_ep_rank=0, moe_dp_size=1,
        moe_dp_rank=0, moe_tp_size=tg, moe_tp_rank=r)
    return tp


@dataclasses.dataclass
class AdoptServerArgs:
    """Test-only request: a scheduler takes its engine's ServerArgs keywords."""

    kwargs: dict


def _adopt(bridge, req):
    """What a scheduler's start does with the engine's ServerArgs: publish them; its model
    runner's WeightUpdater reads ``custom_weight_loaders`` from them (ModelRunner.
    init_weight_updater: ``get_model().custom_weight_loader``, [] once SGLang resolved it)."""
    from sglang.srt.runtime_context import get_model

    from tests.support import sglang_real as real

    real.publish(req.kwargs)
    runner = bridge.manager.tp_worker.model_runner
    runner.weight_updater = dataclasses.replace(  # a frozen dataclass
        runner.weight_updater, custom_weight_loaders=get_model().custom_weight_loader or [])
    return list(runner.weight_updater.custom_weight_loaders)


def adopting_engine(bridge, **kwargs):
    """An ``InProcessEngine`` whose start also hands its ServerArgs keywords to every member's
    scheduler (``adopted``: the custom loaders each member's updater then knows)."""
    from tests.support import sglang_real as real

    engine = real.InProcessEngine(bridge, **kwargs)
    engine.adopted = bridge.call(AdoptServerArgs(
        {k: v for k, v in kwargs.items() if k != "custom_sigquit_handler"}))
    return engine


def _adapter_push(rank, tg, cfg, path, tp, hf, reference):
    """The adapter's colocated path into a fresh model (see the module docstring)."""
    import torch.distributed as dist
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    from hybridrl.config.rollout import RolloutConfig
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.placement import ENGINE_VOCAB_PAD, train_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import build_specs
    from hybridrl.rollout.engine_sync import sync_engine
    from hybridrl.rollout.sglang.adapter import build_sglang_engine
    from hybridrl.rollout.sglang.layout import gen_tp_groups
    from hybridrl.rollout.worker import rollout_gen_placement
    from tests.support import sglang_real as real
    from tests.unit.test_moe_reshard import MOE, rank_shards

    layout = TrainLayout(4, tp=2, pp=1, ep=2, etp=1)
    gen, grouping = rollout_gen_placement(layout, MOE, types.SimpleNamespace(
        tp=tg, pp=1, grouping="hybridflow"), ENGINE_VOCAB_PAD, "sglang")
    all_members = gen_tp_groups(gen)
    members = next(m for m in all_members if rank in m)
    model = Qwen3MoeForCausalLM(cfg, None)
    real.nan_fill(model)
    groups = [dist.new_group(m, backend="gloo") if len(m) > 1 else None for m in all_members]
    bridge, formats, backend = _scheduler(model, tp, members, groups[all_members.index(members)])
    train = train_placement(layout, MOE)
    plan = plan_reshard(train, gen, build_specs(MOE),
                        "zero_redundancy" if grouping == "hybridflow" else "p2p", 0.01, 4)
    handle = build_sglang_engine(path, shape=MOE, all_members=all_members, rank=rank,
                                 device="cpu", dtype=torch.float32,
                                 rollout=RolloutConfig(engine="sglang", timeout_s=60.0),
                                 backend=backend)
    sync_engine(plan, rank, MOE, rank_shards(MOE, hf, train, rank), handle, torch.float32)
    handle.release()
    bridge.stop()
    return _outcome(reference, model, members, tp, formats, bridge, handle)


def _scheduler(model, tp, members, group):
    """One member's stand-in scheduler (SGLang's real updater code), the load formats its
    requests named, and the real backend whose engine hands the members its ServerArgs."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    from hybridrl.rollout.sglang.adapter import sglang_backend
    from tests.support import sglang_real as real

    bridge = real.SchedulerRank(model, tp, members, group)
    bridge.routes[AdoptServerArgs] = functools.partial(_adopt, bridge)
    formats, update = [], bridge.routes[UpdateWeightsFromTensorReqInput]
    bridge.routes[UpdateWeightsFromTensorReqInput] = lambda req: (
        formats.append(req.load_format), update(req))[1]
    bridge.start()
    backend = dataclasses.replace(sglang_backend(),
                                  engine_cls=functools.partial(adopting_engine, bridge))
    return bridge, formats, backend


def _outcome(reference, model, members, tp, formats, bridge, handle) -> dict:
    want, have = dict(reference.named_parameters()), dict(model.named_parameters())
    return {"differ": sorted(n for n in want if not torch.equal(have[n], want[n])),
            "members": members, "sglang_tp_ranks": list(tp.ranks), "formats": set(formats),
            "handled": bridge.handled,
            "adopted": handle.engine.adopted if handle.is_src else None}


def _split_case(rank, world, root):
    """Split placement: training ranks 0-1 (tp 1, ep 2) send over the bridge, generation ranks
    2-3 (one replica, gen tp 2) build their engine with ``build_split_engine`` and receive with
    ``receive_weights``, into a fresh SGLang Qwen3-MoE (None on the training ranks)."""
    import torch.distributed as dist
    from sglang.srt.arg_groups.boundary_reduction import model_boundary_reduction
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    from hybridrl.config.rollout import RolloutConfig
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.parallel.split import build_split_groups
    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan, train_sources
    from hybridrl.rollout.split.engine import build_split_engine, engine_split_plan
    from tests.support import sglang_real as real
    from tests.unit.test_moe_reshard import MOE, make_moe_hf, rank_shards

    cfg, path = _hf_config(MOE), os.path.join(root, "qwen3moe_tp2")  # written by _case
    train = TrainLayout(2, tp=1, ep=2)
    split = build_split_groups(train, 2, 2, timeout_s=120)
    real.publish({"model_path": path, "tp_size": 2, "load_format": "dummy", "dtype": "float32",
                  "skip_tokenizer_init": True, "boundary_reduction": model_boundary_reduction(cfg)})
    tp = _tp_coordinator(2, "split")  # blocks [0, 1], [2, 3]: the replica is one block
    channels = [dist.new_group(m, backend="gloo") if len(m) > 1 else None
                for m in split.gen_replicas()]
    hf, out = make_moe_hf(MOE, seed=11), None
    if split.is_gen:
        model, reference = Qwen3MoeForCausalLM(cfg, None), Qwen3MoeForCausalLM(cfg, None)
        real.nan_fill(model)
        reference.load_weights(list(hf.items()))
        members = split.gen_replicas()[0]
        bridge, formats, backend = _scheduler(model, tp, members, channels[0])
        run = types.SimpleNamespace(
            rollout=RolloutConfig(engine="sglang", timeout_s=60.0),
            model=types.SimpleNamespace(path=path), reshard=types.SimpleNamespace(bucket_mb=0.01))
        engine = build_split_engine(run, split, MOE, train=train, dtype=torch.float32,
                                    uses_te=False, backend=backend)
        engine.receive_weights(True)
        bridge.stop()
        out = _outcome(reference, model, engine.members, tp, formats, bridge, engine.engine)
    else:
        plan = engine_split_plan("sglang", train, MOE, 2, 2, 0.01, torch.float32, False)
        sources = train_sources(plan, rank, rank_shards(MOE, hf, plan.train, rank))
        run_plan(plan, rank, sources, Assembler(plan, rank, None, dtype=torch.float32),
                 group=split.bridge)
    dist.barrier()
    return out


def _case(rank, world, tg, root):
    from sglang.srt.arg_groups.boundary_reduction import model_boundary_reduction
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan, train_sources
    from hybridrl.reshard.formats import engine_format
    from hybridrl.rollout.sglang.layout import engine_param_shapes
    from hybridrl.rollout.sglang.loader import load_direct
    from tests.support import sglang_real as real
    from tests.unit.test_moe_reshard import MOE, make_moe_hf, moe_setup, rank_shards

    cfg = _hf_config(MOE)
    path = os.path.join(root, f"qwen3moe_tp{tg}")
    if rank == 0:
        cfg.save_pretrained(path)
    torch.distributed.barrier()
    real.publish({"model_path": path, "tp_size": tg, "load_format": "dummy", "dtype": "float32",
                  "skip_tokenizer_init": True, "boundary_reduction": model_boundary_reduction(cfg)})
    tp = _tp_coordinator(tg)
    r = tp.rank_in_group
    pushed, reference = Qwen3MoeForCausalLM(cfg, None), Qwen3MoeForCausalLM(cfg, None)
    real.nan_fill(pushed)
    hf = make_moe_hf(MOE, seed=11)
    reference.load_weights(list(hf.items()))  # SGLang's own load path, full HF tensors
    # gen-TP groups in SGLang's order (consecutive ranks), as the worker's sglang_gen_placement
    train, gen, plan = moe_setup(world, 2, 2, 1, tg, bucket_mb=0.01,
                                 grouping="hybridflow" if 2 % tg == 0 else "consecutive")
    assert gen.coords[rank][0] == r, (gen.coords[rank], r)  # gen-TP order == SGLang's TP order
    named = rank_shards(MOE, hf, train, rank)
    got = []
    asm = Assembler(plan, rank, engine_format(MOE, gen, rank), sink=got.extend,
                    sink_every_flush=True)
    run_plan(plan, train_sources(plan, named), asm)
    table = engine_param_shapes(MOE, tg)
    load_direct(pushed, got)
    want, have = dict(reference.named_parameters()), dict(pushed.named_parameters())
    return {"differ": sorted(n for n in want if not torch.equal(have[n], want[n])),
            "bad_shapes": sorted(n for n, t in got if table.get(n) != tuple(t.shape)),
            "loaded": len(got), "table": len(table),
            "adapter": _adapter_push(rank, tg, cfg, path, tp, hf, reference)}


def _all(rank, world, root):
    from tests.support.sglang_prelude import install

    install()
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU payloads across ranks
    out = {tg: _case(rank, world, tg, root) for tg in (1, 2, 4)}
    return out, _split_case(rank, world, root)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(_all, WORLD, str(tmp_path_factory.mktemp("moe_sglang")), timeout=600)


@pytest.mark.slow
def test_sglang_qwen3_moe_loads_the_resharded_experts_bitwise(results):
    for rank, (per_tp, _) in enumerate(results):
        for tg, out in per_tp.items():
            assert out["differ"] == [] and out["bad_shapes"] == [], (rank, tg, out)
            assert out["loaded"] == out["table"], (rank, tg, out)  # every tensor, once


def _check_adapter_push(got, tg, where):
    from hybridrl.rollout.sglang.loader import LOADER

    assert got["differ"] == [], (where, got["differ"])
    assert got["members"] == got["sglang_tp_ranks"]  # gen-TP order == SGLang's TP order
    assert got["formats"] == {LOADER}, (where, got["formats"])
    assert "UpdateWeightsFromTensorReqInput" in got["handled"], where
    if got["adopted"] is not None:  # source: every member's updater knows the loader
        assert got["adopted"] == [[LOADER]] * tg, (where, got["adopted"])


@pytest.mark.slow
def test_adapter_pushes_qwen3_moe_through_the_custom_loader(results):
    for rank, (per_tp, _) in enumerate(results):
        for tg, out in per_tp.items():
            _check_adapter_push(out["adapter"], tg, (rank, tg))


@pytest.mark.slow
def test_split_engine_pushes_qwen3_moe_through_the_custom_loader(results):
    split = [out for _, out in results]
    assert split[:2] == [None, None]  # the training ranks only send
    for rank in (2, 3):
        _check_adapter_push(split[rank], 2, ("split", rank))
