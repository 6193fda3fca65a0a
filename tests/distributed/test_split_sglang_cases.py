"""Torchrun entry: the split plan's weight sync into SGLang's real scheduler-side updater, 4 gloo
ranks on CPU (2 training ranks, tp 2; 2 generation ranks), one launch for every case.

``python -m torch.distributed.run --standalone --nproc-per-node 4 -m
tests.distributed.test_split_sglang_cases OUT`` saves what each rank saw as ``OUT/rank{r}.pt``.
Per case (arch, gen tp): the groups of a split placement (``build_split_groups``), the training
ranks send their megatron shards with ``run_plan`` over the bridge (what ``RemoteRollout``'s
``sync_weights`` does), the generation ranks build their engine with ``build_split_engine``
(cfg.rollout.engine=sglang) and receive with ``receive_weights``, twice (the second sync is
the steady state: nothing re-verified). Real: SGLang's model classes (Llama, tied Llama, Qwen2) and its
``SchedulerWeightUpdaterManager`` / runner ``WeightUpdater`` / ``TpModelWorker.
deserialize_own_rank`` / direct loader / ``MultiprocessingSerializer`` and its request classes
(tests.support.sglang_real). Stood in: the scheduler processes (their ZMQ hop becomes a gloo
channel over the replica's ranks, each scheduler TP rank living in the generation rank that
would own its GPU) and ``sglang.Engine``'s start (no GPU to launch on). Recorded: parameters
that differ bitwise from the same model after its own ``load_weights`` on the HF tensors, the
bytes each rank received / sent, the requests each scheduler rank handled. Last, a probe of
SGLang's ``update_weights_from_distributed`` receive side (``distributed_path_probe``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import types

CASES = (("llama", 2), ("qwen2", 1), ("llama_tied", 2))


def model_classes() -> dict:
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM

    return {"llama": LlamaForCausalLM, "llama_tied": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}


def _vocab_pad_bytes(shape, table: dict, tp_rank: int) -> int:
    """fp32 bytes of this TP rank's vocabulary padding rows (no sender holds them)."""
    chunk, hidden = table["model.embed_tokens.weight"]
    pad_rows = chunk - min(chunk, max(0, shape.vocab - tp_rank * chunk))
    return 4 * pad_rows * hidden * (1 if shape.tied else 2)


def _cfg(path: str, port_base: int):
    from hybridrl.config.rollout import RolloutConfig

    return types.SimpleNamespace(
        rollout=RolloutConfig(engine="sglang", engine_port_base=port_base, timeout_s=120.0),
        model=types.SimpleNamespace(path=path), reshard=types.SimpleNamespace(bucket_mb=0.01))


def case(rank: int, arch: str, gen_tp: int, port_base: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.parallel.split import build_split_groups
    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan, train_sources
    from hybridrl.rollout.sglang.adapter import sglang_backend
    from hybridrl.rollout.sglang.layout import engine_param_shapes
    from hybridrl.rollout.split.engine import build_split_engine, engine_split_plan
    from tests.support import sglang_real as real
    from tests.support.sglang_ranks import _hf_config, _shape
    from tests.unit.test_reshard_oracle import PAD, make_hf, megatron_shards

    shape, path, hf_cfg = _shape(arch), os.path.join(root, arch), _hf_config(arch, root)
    train = TrainLayout(2, tp=2)
    split = build_split_groups(train, 2, gen_tp, timeout_s=120)
    real.publish({"model_path": path, "tp_size": gen_tp, "load_format": "dummy",
                  "dtype": "float32", "skip_tokenizer_init": True})
    tp = real.tp_coordinator(gen_tp)  # blocks of gen_tp ranks: a replica's ranks are one block
    # the stand-in schedulers' channel (their ZMQ hop), apart from the adapter's gloo groups
    channels = [dist.new_group(m, backend="gloo") if len(m) > 1 else None
                for m in split.gen_replicas()]
    hf = make_hf(shape, seed=11)
    out = {"is_gen": split.is_gen}
    syncs = []
    if split.is_gen:
        cls = model_classes()[arch]
        pushed, reference = cls(hf_cfg, quant_config=None), cls(hf_cfg, quant_config=None)
        real.nan_fill(pushed)
        reference.load_weights(list(hf.items()))
        replica = next(i for i, m in enumerate(split.gen_replicas()) if rank in m)
        sched = real.SchedulerRank(pushed, tp, split.gen_replicas()[replica], channels[replica])
        sched.start()
        backend = dataclasses.replace(sglang_backend(),
                                      engine_cls=functools.partial(real.InProcessEngine, sched))
        engine = build_split_engine(_cfg(path, port_base), split, shape, train=train,
                                    dtype=torch.float32, uses_te=False, backend=backend)
        for verify in (True, False):
            stats = engine.receive_weights(verify)
            syncs.append((stats.bytes_received, stats.bytes_sent, stats.buckets))
        sched.stop()
        want, got = dict(reference.named_parameters()), dict(pushed.named_parameters())
        table = engine_param_shapes(shape, gen_tp)
        out.update(differ=sorted(n for n in want if n not in got or not torch.equal(got[n],
                                                                                    want[n])),
                   names=sorted(got), handled=sched.handled, members=engine.members,
                   shard_bytes=sum(4 * torch.Size(s).numel() for s in table.values()),
                   vocab_pad_bytes=_vocab_pad_bytes(shape, table, engine.tp_rank),
                   base_gpu=engine.engine.engine.kwargs["base_gpu_id"] if engine.is_src else None,
                   tp_size=engine.engine.engine.kwargs["tp_size"] if engine.is_src else None)
    else:
        plan = engine_split_plan("sglang", train, shape, 2, gen_tp, 0.01, torch.float32, False)
        b, a, _ = plan.train.coords[rank]
        named = megatron_shards(shape, hf, 2, b, 1, a, plan.train.vocab_chunk, pad_value=PAD)
        for verify in (True, False):
            sources = train_sources(plan, rank, named)
            stats = run_plan(plan, rank, sources, Assembler(plan, rank, None,
                                                            dtype=torch.float32),
                             group=split.bridge, verify=verify)
            syncs.append((stats.bytes_received, stats.bytes_sent, stats.buckets))
    out["syncs"] = syncs
    dist.barrier()
    return out


def distributed_path_probe(rank: int, port: int) -> dict:
    """SGLang's ``update_weights_from_distributed`` receive side, real runner-side code: rank 0
    sends as rank 0 of the custom group (a trainer would), ranks 1 and 2 are an engine's TP
    ranks 0 and 1 (``WeightUpdater`` on cpu, joined by its own ``init_weights_update_group``:
    rank = rank_offset + tp rank), rank 3 stays out. What each TP rank received."""
    import types

    import torch
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.utils import init_custom_process_group

    # the custom group's own store (torchrun's flag would send the rendezvous to the agent's
    # store, as SGLang's scheduler processes never see it: the adapter's start env drops it)
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)  # what the sender holds
    if rank == 0:
        group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                          world_size=3, rank=0, group_name="split-probe")
        torch.distributed.broadcast(full, src=0, group=group)
        return {}
    if rank == 3:
        return {}
    runner = types.SimpleNamespace()
    updater = WeightUpdater(tp_rank=rank - 1, device="cpu", gpu_id=0, model_config=None,
                            custom_weight_loaders={}, get_model=lambda: None,
                            update_model_fields=lambda **kw: None,
                            recapture_cuda_graph=lambda: None, get_model_runner=lambda: runner)
    ok, message = updater.init_weights_update_group("127.0.0.1", port, 1, 3, "split-probe",
                                                    backend="gloo")
    got = updater.receive_weights_from_distributed(
        names=["w"], dtypes=["float32"], shapes=[[6, 4]], group_name="split-probe") if ok else []
    return {"init": (ok, message), "received": [(n, t) for n, t in got]}


def main(out: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.support.sglang_prelude import install
    from tests.support.sglang_ranks import _hf_config

    install()
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU payloads across ranks
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    port_base = int(os.environ["HYBRIDRL_TEST_PORT_BASE"])
    for arch in {a for a, _ in CASES}:
        _hf_config(arch, out, write=rank == 0)
    dist.barrier()
    result = {c: case(rank, *c, port_base, out) for c in CASES}
    result["distributed_path"] = distributed_path_probe(rank, port_base + 2000)
    dist.barrier()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    os._exit(0)  # the scheduler threads and gloo groups need no teardown


if __name__ == "__main__":
    main(sys.argv[1])
