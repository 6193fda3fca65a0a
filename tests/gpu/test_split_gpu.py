"""Split placement on GPUs (issue 39 item 1-2; skipped without 2 CUDA devices): the builtin
engine on a generation rank's own GPU, its weights over NCCL by the split plan.

2 NCCL ranks (training rank 0 on GPU 0, generation rank 1 on GPU 1: NCCL refuses two ranks of
one communicator on one GPU, so 2 GPUs is the least), launched here as torchrun would (RANK,
LOCAL_RANK, ``init_distributed``: rank r on GPU ``LOCAL_RANK``). ``split_builtin_rank`` builds
the split groups (the bridge on NCCL, the command group on gloo), the training rank sends its
megatron shards with ``run_plan`` over the bridge from CUDA tensors, the generation rank builds
``build_split_engine`` (builtin, on ``cuda:1``) and receives twice (new weights the second
time, nothing re-verified). Checked: the engine's tensors are on the rank's GPU and equal,
bitwise, an engine loaded the independent way (``update_weights`` with the oracle's
engine-format shards) on the same GPU; greedy tokens of the two engines are the same; the
generation rank received exactly its engine shard (less the vocabulary padding rows).
The same function runs on 4 gloo ranks on CPU in tests/distributed/test_split_sglang.py
(``test_builtin_split_engine_on_gloo``), gen tp 2 there.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def split_builtin_rank(rank: int, world: int, train_tp: int, gen_tp: int) -> dict:
    """One rank of a split placement: ``world - gen_world`` training ranks at tp ``train_tp``
    and ``gen_world`` = ``world - train_tp`` generation ranks at gen tp ``gen_tp``."""
    import torch.distributed as dist

    from hybridrl.models.spec import LlamaSpec
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.parallel.split import build_split_groups
    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan, train_sources
    from hybridrl.reshard.specs import LlamaShape
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec
    from hybridrl.rollout.split.engine import build_split_engine, engine_split_plan
    from tests.unit.test_reshard_oracle import PAD, engine_shards, make_hf, megatron_shards

    spec = LlamaSpec(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=48, vocab_size=100)
    shape = LlamaShape.from_model(spec)
    train = TrainLayout(train_tp, tp=train_tp)
    gen_world = world - train_tp
    split = build_split_groups(train, gen_world, gen_tp, timeout_s=120)
    device = split.device()
    cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(engine="builtin"),
                                reshard=types.SimpleNamespace(bucket_mb=0.004),
                                model=types.SimpleNamespace(path=""))
    out: dict = {"device": str(device), "backend": split.backend, "bad": [], "received": [],
                 # batches travel on a communicator apart from the weights' (parallel/split.py)
                 "handoff_apart": (split.handoff is not split.bridge
                                   and split.handoff.size() == world)}
    if split.is_gen:
        se = build_split_engine(cfg, split, spec, train=train, dtype=torch.float32,
                                uses_te=False)
        b = se.tp_rank
        chunk = se.plan.gen.vocab_chunk
        real = max(0, min(chunk, shape.vocab - b * chunk))  # vocabulary rows that exist
        for step, seed in enumerate((3, 4)):
            stats = se.receive_weights(verify=step == 0)
            out["received"].append(stats.bytes_received)
            hf = make_hf(shape, seed=seed)
            oracle = BuiltinEngine(EngineSpec.from_llama(spec, chunk), tp_rank=b,
                                   tp_size=gen_tp, device=device,
                                   tp_group=object() if gen_tp > 1 else None)
            oracle.update_weights((n, t.to(device))
                                  for n, t in engine_shards(shape, hf, gen_tp, b, 1, 0,
                                                            chunk).items())
            for name, want in oracle.weights.items():
                got = se.engine.weights[name]
                rows = real if want.dim() == 2 and want.shape[0] == chunk else want.shape[0]
                if got.device != device or not torch.equal(got[:rows], want[:rows]):
                    out["bad"].append((step, name))
        out["engine_devices"] = sorted({str(t.device) for t in se.engine.weights.values()})
        out["shard_bytes"] = sum(4 * (real if t.dim() == 2 and t.shape[0] == chunk
                                      else t.shape[0]) * (t[0].numel() if t.dim() == 2 else 1)
                                 for t in oracle.weights.values())
        if gen_tp == 1:  # the engine generates on its device as the oracle does
            params = SamplingParams(max_new_tokens=6, temperature=0.0)
            got = se.generate([[1, 2, 3], [4, 5]], params).response_ids
            want = oracle.generate([[1, 2, 3], [4, 5]], params).response_ids
            out["same_tokens"] = torch.equal(got.cpu(), want.cpu())
    else:
        plan = engine_split_plan("builtin", train, spec, gen_world, gen_tp, 0.004,
                                 torch.float32, False)
        b = plan.train.coords[rank][0]
        for step, seed in enumerate((3, 4)):
            hf = make_hf(shape, seed=seed)
            named = {n: t.to(device) for n, t in megatron_shards(
                shape, hf, train_tp, b, 1, 0, plan.train.vocab_chunk, pad_value=PAD).items()}
            run_plan(plan, rank, train_sources(plan, rank, named),
                     Assembler(plan, rank, None, dtype=torch.float32, device=device),
                     group=split.bridge, verify=step == 0)
    dist.barrier(group=split.bridge)
    return out


def _nccl_rank(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from hybridrl.parallel.groups import init_distributed

    try:
        init_distributed("nccl", timeout_s=120)
        results.put((rank, split_builtin_rank(rank, world, 1, 1)))
    except BaseException as err:  # reported to the test
        results.put((rank, f"{type(err).__name__}: {err}"))


@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA devices (NCCL: one GPU per rank)")
def test_builtin_split_engine_over_nccl_on_two_gpus():
    import multiprocessing as mp

    from hybridrl.testing.dist import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    assert all(isinstance(v, dict) for v in got.values()), got
    train, gen = got[0], got[1]
    assert train["backend"] == gen["backend"] == "nccl"
    assert train["handoff_apart"] and gen["handoff_apart"]
    assert (train["device"], gen["device"]) == ("cuda:0", "cuda:1")
    assert gen["engine_devices"] == ["cuda:1"]
    assert gen["bad"] == []
    assert gen["received"] == [gen["shard_bytes"]] * 2
    assert gen["same_tokens"]
