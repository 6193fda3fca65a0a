"""The generation side of a PPO step: reshard train shards -> engine, sample, gather back.

Contract:
- ``RolloutWorker(cfg, groups, actor, tokenizer)`` (collective: every rank, same arguments)
  places the generation layout on the training ranks (``rollout_gen_placement``: ``parallel.gen``'s
  grouping when the shards nest, else the placement-optimal one of hybridrl.reshard.assignment,
  which keeps the most of what each rank holds), plans the reshard once (strategy
  ``reshard.strategy``; ``auto`` = zero_redundancy when nested, else p2p), takes this rank's gen
  TP group (``groups.groups["gen_tp"]`` when ``groups`` holds the same gen layout, else one new
  group per gen TP group with a finite timeout) and builds the engine (``rollout.engine``:
  builtin or sglang) on this rank's gen shard, with the engine's vocab padding (SGLang's
  ``ENGINE_VOCAB_PAD`` = 64; the builtin engine pads as training does, and keeps each gen
  shard as ``engine_blocks`` training-shard-shaped parts). Every model the reshard moves is accepted here, q/k/v biases
  (Qwen2) included, and both engines run them.
- ``sync_weights(actor)`` runs the plan: every rank sends what others lack. The builtin engine
  is filled in place (received rows land in its tensors; where a rank's gen shard of a
  parameter is its training shard the engine reads the training tensor itself, unless
  ``actor.param_offload``: ``inplace_targets``; with ``reshard.merge_messages`` transfers
  between two ranks that lie back to back on both sides travel as one message, agreed at the
  first sync: hybridrl.rollout.engine_sync); another engine receives its engine-format
  shard bucket by bucket (``update_weights`` is the sink, called a rank-dependent number of
  times, never communicating). Then ``finish_update()`` exactly once on every rank (the one
  place an engine may run a gen-TP collective). Returns the executor's ``RunStats``. The
  reshard's buffers are on the actor's device. SGLang instead takes one push
  round per reshard phase on a gloo side group (``start_update`` first, ``update_weights`` at
  every flush; hybridrl/rollout/sglang/push.py).
- ``release()`` (collective over the gen-TP group): call it after the rollouts, before the
  training phases; SGLang then gives its GPU memory back (no-op for the builtin engine).
- ``generate(prompts, params, seed)`` (collective): the N prompts are cut into contiguous shares,
  one per gen replica (``numpy.array_split`` order); each replica samples its share with seed
  ``seed * 1_000_003 + replica`` (reproducible, resumable without saved generator state); every
  rank returns the same ``GenerationOutput`` for all N, in prompt order, R = the longest
  response, received as ``generate_partitioned``'s rows are (lengths first, then int32 ids +
  fp32 log-probs, no padding; one part holding every row). (The whole batch on every rank:
  kept for callers that need it; the trainer uses ``generate_partitioned``.)
- ``generate_partitioned(prompts, params, seed, plan_parts)`` (collective): the same replica
  shares, but request i gets its own seed ``request_seed(seed, i)`` (so a sequence's sample does
  not depend on the layout); one all_reduce of an int32 length per sequence, then
  ``plan_parts(lengths)`` -> rows per DP rank (``hybridrl.rollout.partition``) and each rank
  receives only its DP replica's rows, point to point. Returns ``(rows, GenerationOutput of
  them, TransportStats)``. No float64 and no padding to the batch's longest response travel.
- One timeout around generation, ``rollout.timeout_s`` (``timeout_s``). After its generate
  call k, each gen-TP source sets ``GEN_DONE_KEY`` (its rank, k) in the job's store; every rank
  then waits for all sources' keys of call k in the store (``store.wait``: no polling, no
  collective) at most ``timeout_s``, and only then posts the first collective after generate
  (the length all-reduce of the hand-off; NCCL on GPUs), so a slow engine is never waited for
  inside an NCCL collective, whose own group timeout (600 s by default) would abort it first. Past ``timeout_s`` it raises RuntimeError
  naming the late engines (gen-TP group, source rank). That collective is itself waited at
  most ``timeout_s``; the gen-TP groups this worker creates get it as their timeout (SGLang's
  side groups have it too).
"""

from __future__ import annotations

import dataclasses
import datetime

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.parallel.groups import DEFAULT_TIMEOUT_S
from hybridrl.reshard.placement import ENGINE_VOCAB_PAD, gen_placement, train_placement
from hybridrl.reshard.planner import plan_reshard
from hybridrl.reshard.specs import LlamaShape, build_specs
from hybridrl.rollout.base import GenerationOutput, SamplingParams
from hybridrl.rollout.engine_sync import Coalescing, inplace_targets, sync_engine  # noqa: F401 (API)
from hybridrl.rollout.partition import (
    TransportStats,
    check_prefix_mask,
    exchange_rollouts,
    plan_transfers,
)
from hybridrl.rollout.sampling import request_seed

GEN_DONE_KEY = "hybridrl/rollout/gen_done/{}/{}"  # (gen-TP source rank, generate call) finished


def reshard_metrics(stats) -> dict:
    """This rank's weight sync as step metrics (``RunStats``: MB received / sent incl. merged
    messages' holes, messages posted)."""
    return {"reshard/recv_MB": stats.bytes_received / 1e6, "reshard/sent_MB": stats.bytes_sent / 1e6,
            "reshard/messages": float(stats.messages)}


def _gen_tp_groups(gen, rank: int, groups, grouping: str, timeout_s: float | None = None):
    """(this rank's gen TP group or None, its member ranks in gen TP order).

    When ``groups`` was built with this very gen layout (same tp, pp, grouping: the nested
    HybridFlow/vanilla case), its ``gen_tp`` group is reused. Otherwise (consecutive grouping, or
    no/another gen layout in ``groups``) these rank sets are not among ``groups``' families, so one
    group per replica is created here, every rank in the same order, with the same finite timeout
    ``timeout_s`` (``rollout.timeout_s``; None: ``build_groups``' own) so that a missing peer
    raises instead of blocking forever.
    """
    per_replica = [[gen.rank_at(b, 0, rep) for b in range(gen.tp)]
                   for rep in range(gen.world // (gen.tp * gen.pp))]
    members = next(ranks for ranks in per_replica if rank in ranks)
    if gen.tp == 1:
        return None, members
    g = groups.gen
    if g is not None and (g.tp, g.pp, g.grouping) == (gen.tp, gen.pp, grouping):
        assert set(groups.members["gen_tp"]) == set(members), (groups.members["gen_tp"], members)
        return groups.groups["gen_tp"], members
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    mine = None
    for ranks in per_replica:  # same order on every rank
        group = dist.new_group(ranks, timeout=timeout)
        mine = group if rank in ranks else mine
    return mine, members


def rollout_gen_placement(layout, shape: LlamaShape, gen_cfg, vocab_pad: int | None = ENGINE_VOCAB_PAD,
                          engine: str = "builtin"):
    """(gen ``Placement``, its grouping) of the rollout engines: ``gen_cfg.grouping`` when tg | t
    and pg | p, else ``optimal`` (pure). ``vocab_pad``: the engine's vocabulary padding (None:
    megatron's training padding, so each gen vocab chunk is whole training chunks). SGLang:
    a layout whose gen-TP groups follow its GPU order (``hybridrl.rollout.sglang.layout.sglang_gen_placement``)."""
    nested = layout.tp % gen_cfg.tp == 0 and layout.pp % gen_cfg.pp == 0
    grouping = gen_cfg.grouping if nested else "optimal"
    gen = gen_placement(layout, shape, gen_cfg.tp, gen_cfg.pp, grouping, vocab_pad=vocab_pad)
    if engine == "sglang":
        import os

        from hybridrl.rollout.sglang.layout import sglang_gen_placement

        node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
        gen = sglang_gen_placement(train_placement(layout, shape), shape, gen, node)
    return gen, gen.grouping


def engine_blocks(train, gen) -> int:
    """K = train tp / gen tp when the gen shards nest whole training shards (vocabulary chunks
    included), else 1: the builtin engine then keeps each gen shard as K training shards."""
    if train.tp % gen.tp or gen.vocab_chunk != (train.tp // gen.tp) * train.vocab_chunk:
        return 1
    return train.tp // gen.tp


class RolloutWorker:
    """This rank's engine plus the reshard plan that feeds it (see module docstring)."""

    def __init__(self, cfg, groups, actor, tokenizer):
        if cfg.parallel.gen.pp != 1:
            raise ValueError(f"parallel.gen.pp must be 1 (rollout engines run gen pp = 1 here), "
                             f"got {cfg.parallel.gen.pp}")
        self.rank, layout, gen_cfg = groups.rank, groups.train, cfg.parallel.gen
        self.layout = layout
        self.shape = LlamaShape.from_model(actor.spec)  # q/k/v biases move too
        # the builtin engine pads the vocabulary as training does, so that its chunks nest
        # whole training chunks (engine_blocks); SGLang pads to its own multiple
        self.gen, grouping = rollout_gen_placement(
            layout, self.shape, gen_cfg,
            None if cfg.rollout.engine == "builtin" else ENGINE_VOCAB_PAD, cfg.rollout.engine)
        strategy = cfg.reshard.strategy
        if strategy == "auto":
            strategy = "zero_redundancy" if grouping == "hybridflow" else "p2p"
        itemsize = torch.empty((), dtype=actor.config.params_dtype).element_size()
        specs = build_specs(self.shape, "te" if actor.uses_te else "local")
        self.plan = plan_reshard(train_placement(layout, self.shape), self.gen, specs, strategy,
                                 cfg.reshard.bucket_mb, itemsize)
        self.strategy, self.dtype = strategy, actor.config.params_dtype
        tp_rank, _, self.replica = self.gen.coords[self.rank]
        self.n_replicas = self.gen.world // (self.gen.tp * self.gen.pp)
        self.timeout_s = float(cfg.rollout.timeout_s)
        self.generates = 0  # generate calls made (every rank counts the same)
        tp_group, members = _gen_tp_groups(self.gen, self.rank, groups, grouping, self.timeout_s)
        self.is_src = self.rank == members[0]
        self.device = actor.device
        # the builtin engine reads the rank's own training tensors where its gen shard is that
        # shard (no copy); not when the weights leave the device while generating
        self.alias = not cfg.actor.param_offload
        # merged messages, agreed at the first sync (builtin engine; hybridrl.reshard.coalesce)
        self.coalescing = Coalescing() if cfg.reshard.merge_messages else None
        self.engine = self._build_engine(cfg, actor, tp_group, tp_rank, members[0])
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        spec = actor.spec  # routing replay: the engine's expert ids travel with the rows
        self.routing = ((spec.num_layers, spec.moe_topk)
                        if cfg.actor.router_replay == "rollout" and spec.num_experts else None)

    def _build_engine(self, cfg, actor, tp_group, tp_rank, tp_src):
        if cfg.rollout.engine == "sglang":
            return self._build_sglang(cfg, actor)
        from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec

        spec = EngineSpec.from_llama(actor.spec, self.gen.vocab_chunk)
        return BuiltinEngine(spec, tp_group=tp_group, tp_rank=tp_rank, tp_size=self.gen.tp,
                             tp_src=tp_src, device=actor.device, dtype=self.dtype,
                             pp_size=self.gen.pp,
                             blocks=engine_blocks(self.plan.train, self.gen))

    @torch.no_grad()
    def sync_weights(self, actor):
        """Reshard the actor's training shards into the engine (collective)."""
        named = {n: p.detach() for n, p in actor.module.named_parameters()}
        return sync_engine(self.plan, self.rank, self.shape, named, self.engine, self.dtype,
                           self.device, alias=self.alias, coalescing=self.coalescing)

    # ------------------------------------------------------------------ SGLang only
    def _build_sglang(self, cfg, actor, backend=None):
        """One SGLang engine per gen-TP group (collective; see hybridrl/rollout/sglang/adapter.py)."""
        from hybridrl.rollout.sglang.adapter import build_sglang_engine, sglang_backend

        if not cfg.model.path:
            raise ValueError("rollout.engine=sglang needs model.path (an HF folder)")
        backend = backend or sglang_backend()  # version/import check before any collective
        gen = self.gen
        all_members = [[gen.rank_at(b, 0, rep) for b in range(gen.tp)]
                       for rep in range(self.n_replicas)]
        return build_sglang_engine(cfg.model.path, shape=self.shape, all_members=all_members,
                                   rank=self.rank, device=actor.device, dtype=self.dtype,
                                   rollout=cfg.rollout, backend=backend)

    def release(self) -> None:
        """Training phases come next: an engine that can give its GPU memory back does
        (SGLang: ``release_memory_occupation``; the next ``sync_weights`` resumes it)."""
        release = getattr(self.engine, "release", None)
        if release is not None:
            release()

    def sampling_params(self, max_new_tokens: int, temperature: float, top_k: int = -1,
                        top_p: float = 1.0) -> SamplingParams:
        return SamplingParams(max_new_tokens, temperature, top_k, top_p, self.eos_token_id,
                              self.pad_token_id)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seed: int) -> GenerationOutput:
        """Responses for every prompt, the same on every rank (collective)."""
        shares = np.array_split(np.arange(len(prompts)), self.n_replicas)
        mine = [int(i) for i in shares[self.replica]]
        out = None
        if mine:
            params = dataclasses.replace(params, seed=seed * 1_000_003 + self.replica)
            out = self.engine.generate([prompts[i] for i in mine], params)
        self._generated()
        everyone = list(range(len(prompts)))
        _, local, _ = self._handoff(len(prompts), mine, out, lambda lens: [everyone],
                                    [list(range(dist.get_world_size()))])
        return local

    def generate_partitioned(self, prompts: list[list[int]], params: SamplingParams, seed: int,
                             plan_parts) -> tuple[list[int], GenerationOutput, TransportStats]:
        """This DP replica's rows only (see the module docstring; collective)."""
        shares = np.array_split(np.arange(len(prompts)), self.n_replicas)
        gen_rows = [int(i) for i in shares[self.replica]]
        out = None
        if gen_rows:
            seeds = tuple(request_seed(seed, i) for i in gen_rows)
            out = self.engine.generate([prompts[i] for i in gen_rows],
                                       dataclasses.replace(params, seed=seed, row_seeds=seeds))
        self._generated()
        world = dist.get_world_size()
        replicas = [[r for r in range(world) if self.layout.coords(r)["dp"] == d]
                    for d in range(self.layout.dp)]
        return self._handoff(len(prompts), gen_rows, out, plan_parts, replicas,
                             [len(p) for p in prompts] if self.routing else None)

    def _handoff(self, n_prompts: int, gen_rows: list[int], out, plan_parts,
                 replicas: list[list[int]], prompt_lens: list[int] | None = None
                 ) -> tuple[list[int], GenerationOutput, TransportStats]:
        """Lengths to everyone (one int32 all_reduce), ``plan_parts(lengths)`` -> rows of each
        part, then each part's rows to the ranks of ``replicas[part]``, point to point (int32
        ids + fp32 log-probs, no padding: ``partition.exchange_rollouts``)."""
        src_rows = gen_rows if self.is_src else []
        lens = torch.zeros(n_prompts, dtype=torch.int32)
        if src_rows:
            lens[src_rows] = torch.tensor(check_prefix_mask(out), dtype=torch.int32)
        lens = lens.to(self.device)
        self._await_engines("the response lengths")
        # each row has exactly one source: the sum is its length
        self._bounded(dist.all_reduce(lens, async_op=True), "the response lengths")
        lens = [int(v) for v in lens.cpu()]
        parts = plan_parts(lens)
        gen = self.gen
        shares = np.array_split(np.arange(n_prompts), self.n_replicas)
        owner = [gen.rank_at(0, 0, rep) for rep, share in enumerate(shares) for _ in share]
        part = next(d for d, ranks in enumerate(replicas) if self.rank in ranks)
        mine = parts[part]
        transfers = plan_transfers(owner, parts, replicas)
        local, stats = exchange_rollouts(self.rank, transfers, mine, src_rows, out, lens,
                                         self.pad_token_id, self.device,
                                         self.routing if prompt_lens else None, prompt_lens)
        stats.scalar_bytes = 4 * n_prompts
        return mine, local, stats

    # ------------------------------------------------------------------ one timeout
    def _generated(self) -> None:
        """This rank's generate call is done: a gen-TP source says so in the job's store."""
        self.generates += 1
        store = _store()
        if self.is_src and store is not None:
            store.set(GEN_DONE_KEY.format(self.rank, self.generates), "1")

    def _sources(self) -> list[list[int]]:
        gen = self.gen
        return [[gen.rank_at(b, 0, rep) for b in range(gen.tp)] for rep in range(self.n_replicas)]

    def _await_engines(self, what: str) -> None:
        """Wait (in the store, at most ``timeout_s``) until every engine finished this call."""
        store = _store()
        if store is None:
            return
        keys = [GEN_DONE_KEY.format(m[0], self.generates) for m in self._sources()]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception as err:  # the store's timeout (DistStoreError) or a lost store
            late = self.late_engines()
            line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            who = f"late: {'; '.join(late)}" if late else f"the job's store failed ({line})"
            raise RuntimeError(f"rank {self.rank}: {what} after generate did not arrive within "
                               f"rollout.timeout_s={self.timeout_s:g}: {who}") from None

    def _bounded(self, work, what: str) -> None:
        """Wait for the first collective after a generate at most ``timeout_s``."""
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as err:  # gloo/NCCL raise RuntimeError (or DistBackendError) on timeout
            line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise RuntimeError(f"rank {self.rank}: {what} after generate did not arrive within "
                               f"rollout.timeout_s={self.timeout_s:g}: every engine had "
                               f"answered; a peer rank is late ({line})") from None

    def late_engines(self) -> list[str]:
        """The engines whose source has not finished this rank's latest generate call."""
        store = _store()
        if store is None:
            return []
        late = []
        for members in self._sources():
            if not store.check([GEN_DONE_KEY.format(members[0], self.generates)]):
                late.append(f"the {type(self.engine).__name__} of gen-TP group {members} "
                            f"(source rank {members[0]} has not finished generate call "
                            f"{self.generates})")
        return late


def _store():
    """The job's key-value store (the default process group's), or None."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
