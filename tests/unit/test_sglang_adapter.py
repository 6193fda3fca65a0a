"""The SGLang adapter's pure parts and one-rank push (no process group): bad tensors raise
ValueError before anything reaches the engine, an engine's (False, message) raises naming the
first tensor, rounds follow the plan's phases; GPU placement, per-request seeds, stop ids and
the keys the layout owns; gen tp > train tp in SGLang's GPU order; the NCCL environment set
before the first (eagerly created) communicator; the CUDA cache emptied before each resume and
the flush result checked; the rollout keys' defaults and checks."""

from __future__ import annotations

import os
import types

import pytest
import torch

from hybridrl.reshard.planner import Transfer
from hybridrl.reshard.specs import LlamaShape
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.sglang.adapter import (
    build_sglang_engine,
    gpu_placement,
    request_seed,
    sampling_dicts,
)
from hybridrl.rollout.sglang.layout import engine_param_shapes
from hybridrl.rollout.sglang.push import WeightPusher

SHAPE = LlamaShape(hidden=8, ffn=12, heads=2, num_query_groups=2, layers=1, vocab=10)
# rank 0: two local-only keys of one bucket each (2 local phases), sends in bucket 0, receives
# in bucket 2, nothing in bucket 1 (rank 1 is a peer outside the push group)
BUCKETS = [[Transfer("c", 0, 1, 0, 1, 4)], [Transfer("c", 1, 2, 0, 1, 4)],
           [Transfer("c", 1, 0, 0, 1, 4)]]
PLAN = types.SimpleNamespace(
    buckets=BUCKETS, locals=((("a", 0, 2), ("b", 0, 2), ("c", 1, 2)), ()), itemsize=4,
    bucket_bytes=32, spec=lambda key: types.SimpleNamespace(row_numel=4),
    rank_buckets=lambda rank: [([t for t in b if t.src == rank], [t for t in b if t.dst == rank])
                               for b in BUCKETS], _cache={})


def _pusher(answer=(True, "Success")):
    loads = []

    def load(payloads):
        loads.append(payloads)
        return answer

    p = WeightPusher(0, [0], None, engine_param_shapes(SHAPE, 1), torch.float32,
                     lambda named: [n for n, _ in named], load)
    p.start(PLAN)
    return p, loads


def test_rounds_follow_the_plan_phases():
    p, loads = _pusher()
    assert p.phases == [-2, -1, 0, 2]  # the executor's phases (hybridrl.reshard.schedule)
    p.sink([("model.norm.weight", torch.zeros(8))])  # phase -2: local-only key "a"
    p.sink([])  # phase -1: local-only key "b"
    p.sink([])  # after bucket 0 (bucket 1: no transfers here -> an empty round)
    p.sink([("model.layers.0.input_layernorm.weight", torch.zeros(8))])  # after bucket 2
    p.sink([])  # Assembler.result()'s last flush
    p.finish()
    assert p.rounds == 5 and p.round_bytes == [32, 0, 0, 0, 32]
    assert loads == [[["model.norm.weight"]], [["model.layers.0.input_layernorm.weight"]]]


@pytest.mark.parametrize("named, match", [
    ([("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 8))], "not a parameter"),
    ([("model.norm.weight", torch.zeros(9))], r"shape \(9,\), the SGLang model's is \(8,\)"),
    ([("model.norm.weight", torch.zeros(8, dtype=torch.float16))], "engine runs torch.float32"),
])
def test_bad_tensors_raise_before_the_engine(named, match):
    p, loads = _pusher()
    with pytest.raises(ValueError, match=match):
        p.sink(named)
    assert loads == []


def test_engine_failure_names_the_first_tensor():
    p, _ = _pusher((False, "Unknown load_format=x"))
    with pytest.raises(RuntimeError, match=r"first tensor 'model.norm.weight'.*load_format=x"):
        p.sink([("model.norm.weight", torch.zeros(8))])
    p, loads = _pusher()
    p.src_error = "RuntimeError: session already open"
    with pytest.raises(RuntimeError, match="session already open"):
        p.sink([])
    assert loads == []


def test_gpu_placement():
    assert gpu_placement([("n0", 4), ("n0", 5)]) == (4, 1)
    assert gpu_placement([("n0", 1), ("n0", 3), ("n0", 5), ("n0", 7)]) == (1, 2)
    assert gpu_placement([("n1", 6)]) == (6, 1)
    with pytest.raises(ValueError, match="one node"):
        gpu_placement([("n0", 0), ("n1", 0)])
    with pytest.raises(ValueError, match="evenly spaced"):
        gpu_placement([("n0", 0), ("n0", 1), ("n0", 3)])


def test_sampling_dicts_seed_every_request():
    params = SamplingParams(max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9,
                            eos_token_id=2, seed=123)
    dicts = sampling_dicts(params, 6)
    seeds = [d["sampling_seed"] for d in dicts]
    assert len(set(seeds)) == 6 and seeds == [request_seed(123, i) for i in range(6)]
    assert all(0 <= s < 2**63 for s in seeds + [request_seed(2**62, 5)])
    assert dicts[0] == {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
                        "stop_token_ids": [2], "sampling_seed": seeds[0]}
    assert "stop_token_ids" not in sampling_dicts(SamplingParams(max_new_tokens=1), 1)[0]


def test_layout_owned_engine_kwargs_are_refused():
    rollout = types.SimpleNamespace(engine_kwargs={"tp_size": 8}, engine_start_timeout_s=1.0,
                                    engine_port_base=30000)
    with pytest.raises(ValueError, match=r"must not set \['tp_size'\]"):
        build_sglang_engine("m", shape=SHAPE, all_members=[[0]], rank=0, device="cpu",
                            dtype=torch.float32, rollout=rollout)


def test_gen_tp_above_train_tp_gets_sglangs_gpu_order():
    """Train tp 4 pp 2 -> gen tp 8: the optimal grouping's order [0, 4, 1, 5, ...] is not the
    GPU order SGLang assigns (base + k * step); the chosen layout is, and keeps what it can."""
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.placement import gen_placement, train_placement
    from hybridrl.rollout.sglang.layout import (
        gen_tp_groups,
        sglang_gen_placement,
        sglang_order_problem,
    )
    from tests.unit.test_reshard_oracle import SMALL

    for world, t, p, tg in [(8, 4, 2, 8), (8, 2, 2, 4), (8, 2, 1, 4), (16, 2, 2, 8)]:
        layout = TrainLayout(world, tp=t, pp=p)
        optimal = gen_placement(layout, SMALL, tg, 1, "optimal", vocab_pad=64)
        assert sglang_order_problem(optimal) is not None  # what was refused before
        chosen = sglang_gen_placement(train_placement(layout, SMALL), SMALL, optimal)
        assert sglang_order_problem(chosen) is None, gen_tp_groups(chosen)
        assert sorted(r for g in gen_tp_groups(chosen) for r in g) == list(range(world))
    layout = TrainLayout(8, tp=4, pp=2)
    chosen = sglang_gen_placement(train_placement(layout, SMALL), SMALL,
                                  gen_placement(layout, SMALL, 8, 1, "optimal", vocab_pad=64))
    assert gen_tp_groups(chosen) == [list(range(8))]
    nested = gen_placement(layout, SMALL, 2, 1, "hybridflow", vocab_pad=64)
    assert sglang_gen_placement(train_placement(layout, SMALL), SMALL, nested) is nested
    with pytest.raises(ValueError, match="no generation layout of gen tp 8 fits SGLang's GPU "
                                         "order.*not ascending"):
        sglang_gen_placement(train_placement(layout, SMALL), SMALL,
                             gen_placement(layout, SMALL, 8, 1, "optimal", vocab_pad=64), 4)


def test_nccl_env_set_before_the_first_communicator(monkeypatch):
    """init_distributed(nccl): NCCL_ENV set (launcher values kept) before init_process_group,
    which gets device_id (eager communicator); gloo touches nothing."""
    import torch.distributed as dist

    from hybridrl.parallel import groups

    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs, env={k: os.environ.get(k) for k in groups.NCCL_ENV})

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # set by the launcher: kept
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    groups.init_distributed("nccl")
    assert seen["env"] == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "1"}
    assert seen["device_id"] == torch.device("cuda", 3) and seen["backend"] == "nccl"
    monkeypatch.delenv("NCCL_CUMEM_ENABLE")
    seen.clear()
    groups.init_distributed("gloo")
    assert seen["device_id"] is None and seen["env"]["NCCL_CUMEM_ENABLE"] is None


def test_rollout_config_sglang_keys():
    from hybridrl.config.rollout import RolloutConfig

    cfg = RolloutConfig()
    assert (cfg.mem_fraction_static, cfg.timeout_s, cfg.deterministic) == (0.5, 3600.0, False)
    with pytest.raises(ValueError, match="rollout.timeout_s must be > 0"):
        RolloutConfig(timeout_s=0)
    with pytest.raises(ValueError, match=r"rollout.mem_fraction_static must be in \(0.0, 1.0\]"):
        RolloutConfig(mem_fraction_static=1.5)


def test_engine_resumes_only_after_every_member_emptied_its_cache_and_flush_is_checked():
    """One-member engine: the cache is emptied before each resume; a flush that answers
    success=False fails the sync."""
    from hybridrl.rollout.sglang.adapter import SGLangEngine
    from tests.support.sglang_fake import FakeEngine, fake_backend

    engine = FakeEngine(tp_size=1)
    engine.flush_answer = types.SimpleNamespace(success=False, message="pending requests")
    handle = SGLangEngine(engine, fake_backend(), rank=0, members=[0],
                          tp_group=None, table=engine_param_shapes(SHAPE, 1),
                          dtype=torch.float32)
    emptied = []
    handle._empty_cache = lambda: emptied.append(list(handle.engine.calls))
    handle.start_update(PLAN)
    for _ in range(5):
        handle.update_weights([])
    with pytest.raises(RuntimeError, match="flush_cache failed: pending requests"):
        handle.finish_update()
    assert emptied == [[], ["resume_memory_occupation:weights", "begin_weight_update"]]


def test_qwen3_norms_are_sglang_parameters():
    """Qwen3's per-head q/k norms (the reshard's engine format emits them) are parameters of
    SGLang's Qwen3 model on every TP rank: [head_dim], replicated."""
    shape = LlamaShape(hidden=64, ffn=96, heads=8, num_query_groups=4, layers=1, vocab=100,
                       head_dim=16, qk_norm=True)
    for tp in (1, 2, 4):
        table = engine_param_shapes(shape, tp)
        assert table["model.layers.0.self_attn.q_norm.weight"] == (16,)
        assert table["model.layers.0.self_attn.k_norm.weight"] == (16,)
        assert table["model.layers.0.self_attn.o_proj.weight"] == (64, 8 * 16 // tp)
