"""Torchrun entry for the tests that run SGLang's real code on 4 gloo ranks (CPU).

``python -m torch.distributed.run --standalone --nproc-per-node 4 -m tests.support.sglang_ranks
OUT`` runs, on every rank of a torchrun-launched world (so the environment is torchrun's own,
``TORCHELASTIC_USE_AGENT_STORE`` included), and saves what each rank saw as ``OUT/rank{r}.pt``:
- ``start``: ``build_sglang_engine`` over one gen-TP group of 4 whose "engine", on rank 0, runs
  SGLang's own ``_set_envs_and_config`` on a real ``ServerArgs`` built from the adapter's keywords,
  then spawns one process (multiprocessing ``spawn``, as SGLang starts its schedulers) that runs
  SGLang's ``init_distributed_environment`` on ``tcp://127.0.0.1:<nccl_port>`` with a store timeout
  of ``STORE_TIMEOUT_S``: seconds taken, error, and the environment the child and every rank saw.
- ``models``: SGLang's real Llama / tied Llama / Qwen2 / Qwen3 (q/k norms, explicit head_dim)
  / Llama with llama3 rope scaling at gen tp 1, 2 and 4 (train tp 2 pp 2,
  hybridrl's reshard from megatron shards), pushed by the adapter (``sglang_backend()``'s real
  serializer and request class) through SGLang's scheduler-side updater with sessions and the
  direct loader (``tests.support.sglang_real``), against the same model after its own
  ``load_weights`` on the full HF tensors: names that differ bitwise, the requests each scheduler
  rank handled, the engine calls; for gen tp 2 a second sync whose flush fails.
- ``timeout``: a gen-TP group of 2 whose source never answers ``generate`` with
  ``rollout.timeout_s`` = 2: what the waiting rank raised and after how long.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
import os
import sys
import time
import types

STORE_TIMEOUT_S = 20
SPAWN_WAIT_S = 240
ARCHS = ("llama", "llama_tied", "qwen2", "qwen3", "llama3")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _scheduler_init(port: int, conn) -> None:
    """A spawned 'scheduler': SGLang's init_distributed_environment, as its bootstrap calls it."""
    from tests.support.sglang_prelude import install

    install()
    from sglang.srt.distributed.parallel_state import init_distributed_environment

    seen = {k: os.environ.get(k) for k in ("TORCHELASTIC_USE_AGENT_STORE", "NCCL_CUMEM_ENABLE")}
    t0, error = time.monotonic(), None
    try:
        init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     timeout=STORE_TIMEOUT_S)
    except Exception as err:  # reported to the parent
        error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    conn.send((time.monotonic() - t0, error, seen))


class SpawningEngine:
    """Stands in for ``sglang.Engine.__init__``: SGLang's env setter, then one scheduler."""

    last = None

    def __init__(self, **kwargs):
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.server_args import ServerArgs

        _set_envs_and_config(ServerArgs(**kwargs, device="cpu"))
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_scheduler_init, args=(kwargs["nccl_port"], child))
        proc.start()
        if not parent.poll(SPAWN_WAIT_S):
            proc.kill()
            raise RuntimeError("the scheduler process did not report")
        self.elapsed, self.error, self.child_env = parent.recv()
        proc.join()
        SpawningEngine.last = self
        if self.error:
            raise RuntimeError(f"scheduler init failed after {self.elapsed:.1f} s: {self.error}")

    def release_memory_occupation(self, tags=None):
        return None


def _rollout(port_base: int, **kw):
    from hybridrl.config.rollout import RolloutConfig

    return RolloutConfig(engine="sglang", engine_port_base=port_base, **kw)


def case_start(rank: int, port_base: int, model_path: str) -> dict:
    import torch

    from hybridrl.reshard.specs import LlamaShape
    from hybridrl.rollout.sglang.adapter import build_sglang_engine, sglang_backend
    from hybridrl.rollout.sglang.env import GUARDED

    def env():
        return {k: v for k, v in os.environ.items() if k in GUARDED or k.startswith("NCCL_")}

    before, method = env(), mp.get_start_method(allow_none=True)
    backend = dataclasses.replace(sglang_backend(), engine_cls=SpawningEngine)
    shape = LlamaShape(hidden=64, ffn=96, heads=8, num_query_groups=4, layers=2, vocab=1000)
    t0, error = time.monotonic(), None
    try:
        build_sglang_engine(model_path, shape=shape, all_members=[[0, 1, 2, 3]], rank=rank,
                            device="cpu", dtype=torch.float32, rollout=_rollout(port_base),
                            backend=backend)
    except RuntimeError as err:
        error = str(err)
    eng = SpawningEngine.last
    return {"error": error, "seconds": time.monotonic() - t0, "env_before": before,
            "env_after": env(), "start_method": (method, mp.get_start_method(allow_none=True)),
            "init_seconds": eng and eng.elapsed, "child_env": eng and eng.child_env}


def _shape(arch: str):
    from hybridrl.reshard.specs import LlamaShape
    from tests.unit.test_sglang_contract import SHAPES

    if arch == "qwen3":  # q/k norms, head_dim 16 != hidden / heads
        return LlamaShape(hidden=64, ffn=96, heads=8, num_query_groups=4, layers=2, vocab=1000,
                          head_dim=16, qk_norm=True)
    return SHAPES[{"llama": "Llama", "llama3": "Llama", "llama_tied": "Llama-tied",
                   "qwen2": "Qwen2"}[arch]]


def _hf_config(arch: str, root: str, write: bool = False):
    """The HF config of ``arch``'s test shape; written to ``root/arch`` (the model path)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    shape = _shape(arch)
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}.get(arch, LlamaConfig)
    extra = {"qwen3": {"head_dim": shape.head_dim},
             "llama3": {"rope_scaling": LLAMA3_ROPE}}.get(arch, {})
    cfg = cls(hidden_size=shape.hidden, intermediate_size=shape.ffn,
              num_attention_heads=shape.heads, num_key_value_heads=shape.num_query_groups,
              num_hidden_layers=shape.layers, vocab_size=shape.vocab,
              tie_word_embeddings=shape.tied, torch_dtype="float32", **extra)
    if write:
        cfg.save_pretrained(os.path.join(root, arch))
    return cfg


def case_model(rank: int, arch: str, tp_size: int, port_base: int, root: str) -> dict:
    import torch
    import torch.distributed as dist
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM

    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.placement import ENGINE_VOCAB_PAD, train_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import build_specs
    from hybridrl.rollout.engine_sync import sync_engine
    from hybridrl.rollout.sglang.adapter import build_sglang_engine, sglang_backend
    from hybridrl.rollout.sglang.layout import gen_tp_groups
    from hybridrl.rollout.worker import rollout_gen_placement
    from tests.support import sglang_real as real
    from tests.unit.test_reshard_oracle import PAD, make_hf, megatron_shards

    shape, path, hf_cfg = _shape(arch), os.path.join(root, arch), _hf_config(arch, root)
    layout = TrainLayout(4, tp=2, pp=2)
    gen, grouping = rollout_gen_placement(layout, shape, types.SimpleNamespace(
        tp=tp_size, pp=1, grouping="hybridflow"), ENGINE_VOCAB_PAD, "sglang")
    all_members = gen_tp_groups(gen)
    members = next(m for m in all_members if rank in m)
    from sglang.srt.arg_groups.boundary_reduction import model_boundary_reduction

    # SGLang's resolution (which cannot run on CPU) picks the layer-boundary reduction of the
    # model; Qwen3's layers read it at construction
    extra = {"boundary_reduction": model_boundary_reduction(hf_cfg)} if arch == "qwen3" else {}
    real.publish({"model_path": path, "tp_size": tp_size, "load_format": "dummy",
                  "dtype": "float32", "skip_tokenizer_init": True, **extra})
    tp = real.tp_coordinator(tp_size)
    cls = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}.get(arch, LlamaForCausalLM)
    pushed, reference = cls(hf_cfg, quant_config=None), cls(hf_cfg, quant_config=None)
    real.nan_fill(pushed)
    hf = make_hf(shape, seed=7)
    if shape.qk_norm:  # the oracle's HF tensors have no q/k norms: add them
        gen_ = torch.Generator().manual_seed(8)
        for L in range(shape.layers):
            for n in ("q", "k"):
                hf[f"model.layers.{L}.self_attn.{n}_norm.weight"] = torch.randn(
                    shape.head_dim, generator=gen_)
    reference.load_weights(list(hf.items()))
    groups = [dist.new_group(m, backend="gloo") if len(m) > 1 else None for m in all_members]
    bridge = real.SchedulerRank(pushed, tp, members, groups[all_members.index(members)])
    bridge.start()
    backend = dataclasses.replace(sglang_backend(),
                                  engine_cls=functools.partial(real.InProcessEngine, bridge))
    strategy = "zero_redundancy" if grouping == "hybridflow" else "p2p"
    plan = plan_reshard(train_placement(layout, shape), gen, build_specs(shape), strategy,
                        0.01, 4)
    handle = build_sglang_engine(path, shape=shape, all_members=all_members, rank=rank,
                                 device="cpu", dtype=torch.float32,
                                 rollout=_rollout(port_base, timeout_s=120.0), backend=backend)
    b, a, _ = plan.train.coords[rank]
    named = megatron_shards(shape, hf, 2, b, 2, a, plan.train.vocab_chunk, pad_value=PAD)
    for local in range(shape.layers // 2) if shape.qk_norm else ():  # replicated on each rank
        for n in ("q", "k"):
            L = a * (shape.layers // 2) + local
            named[f"decoder.layers.{local}.self_attention.{n}_layernorm.weight"] = \
                hf[f"model.layers.{L}.self_attn.{n}_norm.weight"].clone()
    sync_engine(plan, rank, shape, named, handle, torch.float32)
    handle.release()
    flush_error = None
    if tp_size == 2 and arch == "llama":  # a failed flush must fail the sync on every rank
        if handle.is_src:
            handle.engine.flush_ok = False
        try:
            sync_engine(plan, rank, shape, named, handle, torch.float32)
        except RuntimeError as err:
            flush_error = str(err)
    bridge.stop()
    want = dict(reference.named_parameters())
    got = dict(pushed.named_parameters())
    differ = sorted(n for n in want if n not in got or not torch.equal(got[n], want[n]))
    return {"members": members, "sglang_tp_ranks": list(tp.ranks), "grouping": grouping,
            "differ": differ, "names": sorted(got), "handled": bridge.handled,
            "calls": handle.engine.calls if handle.is_src else None, "flush_error": flush_error}


def case_timeout(rank: int, port_base: int) -> dict:
    import torch
    import torch.distributed as dist

    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.sglang.adapter import build_sglang_engine
    from tests.support.sglang_fake import fake_backend
    from tests.unit.test_reshard_oracle import SMALL

    rollout = _rollout(port_base, timeout_s=2.0)
    handle = build_sglang_engine("hf/", shape=SMALL, all_members=[[0, 1], [2, 3]], rank=rank,
                                 device="cpu", dtype=torch.float32, rollout=rollout,
                                 backend=fake_backend())
    t0, error = time.monotonic(), None
    if rank == 1:  # waits for rank 0, which never answers
        try:
            handle.generate([[1, 2]], SamplingParams(max_new_tokens=1))
        except RuntimeError as err:
            error = str(err)
    seconds = time.monotonic() - t0
    dist.barrier()  # rank 0 stays, silent, until rank 1's wait ended (was: a 4 s sleep on
    return {"error": error, "seconds": seconds}  # rank 0, which a loaded machine could outlast)


def main(out: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.support.sglang_prelude import install

    install()
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU payloads across ranks
    torch.set_num_threads(1)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    port_base = int(os.environ["HYBRIDRL_TEST_PORT_BASE"])
    result = {"agent_store": agent_store}
    for arch in ARCHS:  # the model paths SGLang's ServerArgs read
        _hf_config(arch, out, write=rank == 0)
    dist.barrier()
    t0 = time.monotonic()
    result["start"] = case_start(rank, port_base, os.path.join(out, "llama"))
    result["start_wall"] = time.monotonic() - t0
    dist.barrier()
    result["models"] = {}
    for arch in ARCHS:
        for tp_size in (1, 2, 4):
            result["models"][(arch, tp_size)] = case_model(rank, arch, tp_size, port_base, out)
    result["timeout"] = case_timeout(rank, port_base)
    result["wall"] = time.monotonic() - t0
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    os._exit(0)  # the timed-out gloo group and the scheduler threads need no teardown


if __name__ == "__main__":
    main(sys.argv[1])
