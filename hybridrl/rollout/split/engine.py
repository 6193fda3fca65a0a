"""A generation rank's engine in a split placement: builtin or SGLang, on the rank's own device.

Contract:
- ``split_vocab_pad(engine)``: the vocabulary padding of the generation layout: None (the
  builtin engine pads as training does) or ``ENGINE_VOCAB_PAD`` (SGLang's 64). Both sides of
  the bridge must build the split plan with it (``engine_split_plan``), or their plans differ.
- ``engine_split_plan(engine, train, spec, gen_world, gen_tp, bucket_mb, dtype, uses_te)``
  (pure): the ``split`` reshard plan (``reshard.planner``: each generation rank receives
  exactly its engine shard once, the sending balanced over the training ranks) for ``engine``.
- ``build_split_engine(cfg, split, spec, *, train, dtype, uses_te, backend=None)`` (every
  generation rank; collective over the generation ranks for SGLang) -> ``SplitEngine``:
  the engine of this rank's replica (``split.gen_replicas()``: gen tp consecutive ranks) on
  ``split.device()`` (CUDA: GPU ``LOCAL_RANK``, the bridge on NCCL; else the CPU, gloo):
  ``cfg.rollout.engine`` builtin: ``BuiltinEngine`` on the gen-TP group ``split.gen_tp``;
  sglang: one ``sglang.Engine`` per replica, started by the replica's first rank with
  ``tp_size`` = gen tp and ``base_gpu_id`` = that rank's local GPU (``gpu_id_step`` = the
  stride of its members' GPUs: 1 for consecutive local ranks), through
  ``rollout.sglang.adapter.build_sglang_engine`` on the split's gloo side groups
  (``gen_tp_gloo``, ``gen_gloo``); generation ranks never touch the default group.
- ``SplitEngine.receive_weights(verify)`` (every generation rank, while every training rank
  sends its pieces with ``reshard.executor.run_plan`` over ``split.bridge``): runs the plan over
  the bridge. Builtin: the received rows land in the engine's tensors (no conversion, no copy).
  SGLang: the rows are assembled in the engine format (HF names, ``qkv_proj``/``gate_up_proj``
  fused, vocab padded to 64) on this rank's device, bucket by bucket, and every flush is one
  push round into the engine's scheduler-side updater (``update_weights_from_tensor``, load
  format ``direct``, or for a MoE model the adapter's custom loader ``rollout.sglang.loader``,
  each expert's shard into its slot of the FusedMoE tensors: each TP rank's parameters take
  its own shard, in place; CUDA IPC on the rank's own GPU), so a bucket's rows are loaded while the next bucket is on the wire and the
  whole shard is never buffered. ``finish_update`` after the last round. Returns ``RunStats``.
  Why not SGLang's ``update_weights_from_distributed``: in 0.5.21 every TP rank of the engine
  receives each tensor whole, broadcast from rank 0 of a custom group it joins
  (``init_weights_update_group``: rank = rank_offset + tp_rank), then its model's
  ``load_weights`` slices its shard: it cannot take a per-rank shard (gen tp x the bytes per
  GPU), has one sender (not balanced over the training ranks), and its NCCL group cannot hold
  a sender on the same GPU as a scheduler (this rank's). docs/scaling.md has the figures.
- ``SplitEngine.generate(prompts, params)`` (every rank of the replica) and ``engine``, ``plan``,
  ``tp_rank``, ``members``, ``is_src``, ``device``.
Imports downward only: reshard, rollout (protocol, engine_sync), rollout.builtin, rollout.sglang.
"""

from __future__ import annotations

import dataclasses

import torch

from hybridrl.reshard.assemble import Assembler
from hybridrl.reshard.executor import RunStats, run_plan
from hybridrl.reshard.formats import engine_format
from hybridrl.reshard.placement import ENGINE_VOCAB_PAD, split_placements
from hybridrl.reshard.planner import SPLIT, Plan, plan_reshard
from hybridrl.reshard.specs import LlamaShape, build_specs
from hybridrl.rollout.engine_sync import inplace_targets

ENGINES = ("builtin", "sglang")


def split_vocab_pad(engine: str) -> int | None:
    """Vocabulary padding of a split generation layout for ``engine`` (module docstring)."""
    if engine not in ENGINES:
        raise ValueError(f"rollout.engine must be one of {ENGINES} in a split placement; "
                         f"got {engine!r}")
    return ENGINE_VOCAB_PAD if engine == "sglang" else None


def engine_split_plan(engine: str, train, spec, gen_world: int, gen_tp: int, bucket_mb: float,
                      dtype: torch.dtype, uses_te: bool) -> Plan:
    """The split plan of ``train`` and its generation ranks, for ``engine`` (pure)."""
    shape = spec if isinstance(spec, LlamaShape) else LlamaShape.from_model(spec)
    train_pl, gen_pl = split_placements(train, shape, gen_world, gen_tp, 1,
                                        vocab_pad=split_vocab_pad(engine))
    itemsize = torch.empty((), dtype=dtype).element_size()
    return plan_reshard(train_pl, gen_pl, build_specs(shape, "te" if uses_te else "local"),
                        SPLIT, bucket_mb, itemsize)


@dataclasses.dataclass
class SplitEngine:
    """One generation rank's engine and how its weights arrive (module docstring)."""

    kind: str
    engine: object
    plan: Plan
    shape: LlamaShape
    rank: int
    members: list[int]
    bridge: object
    dtype: torch.dtype
    device: torch.device

    @property
    def tp_rank(self) -> int:
        return self.members.index(self.rank)

    @property
    def is_src(self) -> bool:
        return self.rank == self.members[0]

    @torch.no_grad()
    def receive_weights(self, verify: bool = True) -> RunStats:
        """This rank's engine shard over the bridge, into the engine (module docstring)."""
        if self.kind == "builtin":
            asm = Assembler(self.plan, self.rank, None, dtype=self.dtype, device=self.device,
                            zero_padding=False,
                            into=inplace_targets(self.plan, self.rank, {}, self.engine, False),
                            spare=getattr(self.engine, "spare", None))
        else:
            self.engine.start_update(self.plan)
            asm = Assembler(self.plan, self.rank, engine_format(self.shape, self.plan.gen,
                                                                self.rank),
                            sink=self.engine.update_weights, dtype=self.dtype, device=self.device,
                            sink_every_flush=True)
        stats = run_plan(self.plan, self.rank, {}, asm, group=self.bridge, verify=verify)
        asm.result()
        self.engine.finish_update()
        return stats

    def generate(self, prompts: list[list[int]], params):
        """The replica's engine samples ``prompts`` (every rank of the replica calls it)."""
        return self.engine.generate(prompts, params)


def build_split_engine(cfg, split, spec, *, train, dtype: torch.dtype, uses_te: bool,
                       backend=None) -> SplitEngine:
    """This generation rank's engine (module docstring). ``backend``: SGLang's
    (``adapter.SGLangBackend``; tests pass one whose engine runs in process)."""
    engine_kind = cfg.rollout.engine
    gen_world = len(split.gen_ranks)
    plan = engine_split_plan(engine_kind, train, spec, gen_world, split.gen_tp_size,
                             cfg.reshard.bucket_mb, dtype, uses_te)
    shape = spec if isinstance(spec, LlamaShape) else LlamaShape.from_model(spec)
    rank, device = split.rank, split.device()
    tp_rank, _, replica = plan.gen.coords[rank]
    members = split.gen_replicas()[replica]
    if members[tp_rank] != rank:
        raise AssertionError(f"rank {rank}: gen TP rank {tp_rank} of replica {members}")
    if engine_kind == "builtin":
        from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec

        engine = BuiltinEngine(EngineSpec.from_llama(spec, plan.gen.vocab_chunk),
                               tp_group=split.gen_tp, tp_rank=tp_rank, tp_size=plan.gen.tp,
                               tp_src=members[0], device=device, dtype=dtype, pp_size=1,
                               blocks=1)
    else:
        from hybridrl.rollout.sglang.adapter import build_sglang_engine

        if not cfg.model.path:
            raise ValueError("rollout.engine=sglang needs model.path (an HF folder)")
        engine = build_sglang_engine(cfg.model.path, shape=shape,
                                     all_members=split.gen_replicas(), rank=rank, device=device,
                                     dtype=dtype, rollout=cfg.rollout, backend=backend,
                                     groups=(split.gen_tp_gloo, split.gen_gloo))
    return SplitEngine(engine_kind, engine, plan, shape, rank, members, split.bridge, dtype,
                       device)
