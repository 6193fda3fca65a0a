"""The training ranks' rollout worker of a split placement: the engine runs on other ranks.

Contract:
- ``build_rollout_worker(cfg, groups, actor, tokenizer, split=None)``: a ``RolloutWorker``
  (colocated) or, with ``split`` (``hybridrl.parallel.split.SplitGroups``), a ``RemoteRollout``.
- ``RemoteRollout(cfg, groups, actor, tokenizer, split)`` (every training rank) has the
  interface the trainer uses of ``RolloutWorker`` (``sync_weights``, ``generate_partitioned``,
  ``sampling_params``, ``release``, ``gen``, ``n_replicas``, ``strategy``) and talks to the
  generation ranks' loop (``hybridrl.rollout.split.server``). Construction: rank 0 sends the model
  description; every rank derives the ``split`` plan (``link.build_split_plan``).
  ``sync_weights(actor)``: rank 0 says ``sync``, then every training rank sends its pieces
  over the bridge (each generation rank receives exactly its engine shard once, balanced over
  the training ranks, bucketed: ``reshard.planner``'s split strategy); returns ``RunStats``.
- ``request(prompts, params, seed)`` (rank 0 sends, every training rank records it) starts a
  generation and returns at once; several may be outstanding (``rollout.async_steps``), the
  generation ranks take the commands in order. ``collect(seed=None)`` receives the outstanding
  requests' response lengths in request order up to ``seed`` (all when None), each wait at most
  ``rollout.timeout_s`` (``link.recv_lengths``), and keeps them (``Results``) with the
  replicas' generation seconds, the seconds this rank waited and the weight syncs the
  generation ranks had received when they generated them (``last_gen_s``, ``last_wait_s``,
  ``last_syncs``: those of the results ``generate_partitioned`` used last). ``in_flight()``:
  requests started and not yet used.
  ``generate_partitioned(prompts, params, seed, plan_parts)`` uses kept results of the same
  request, else collects an outstanding one, else requests and collects; then
  ``plan_parts(lengths)`` -> rows per DP rank, rank 0 sends ``handoff`` and each training rank
  receives only its DP replica's rows, int32 ids + fp32 log-probs without padding
  (``link.recv_rows``; row order and right padding as ``RolloutWorker.generate_partitioned``:
  the same tensors). ``TransportStats``: ``bytes_in`` = this rank's rows, ``scalar_bytes`` =
  the lengths and headers (``link.handoff_bytes``).
- ``kept_state(seed)`` / ``keep(states)``: request ``seed``'s results as plain data in the
  hand-off's wire form (response lengths, then the unpadded int32 ids and fp32 log-probs: 8
  bytes per real token, where the padded int64 ids + mask + log-probs of earlier checkpoints,
  which ``keep`` still loads, cost 20 per padded position), the whole batch on rank 0 (collective: a ``handoff`` of every row to rank 0 with ``drop=False``, so the
  generation ranks still hand it off later; other ranks return None) and back (a list of them:
  the in-flight batches a checkpoint holds; kept whole on every rank, no hand-off needed).
  Results are kept per request, so a validation generated between a prefetch and its use does
  not displace the prefetched batch.
- Failure lines (``who(src)``): a generation replica is named by its first rank, its replica
  index and the last command rank 0 sent (``link.GenerationTimeout``).
- ``close()`` (every training rank; rank 0 says ``stop``): the generation loop ends.
- No collective on the default group: rank 0 <-> generation ranks on the command group, every
  training rank <-> generation ranks on the bridge (weights) and the hand-off group (batches:
  ``split.handoff``, else the bridge), point to point. Every receive follows the generation
  ranks' posting order (the lengths of every request commanded before a ``handoff`` are
  collected before its rows), as NCCL needs.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from hybridrl.reshard.assemble import Assembler
from hybridrl.reshard.executor import run_plan, train_sources
from hybridrl.rollout.base import GenerationOutput, SamplingParams
from hybridrl.rollout.partition import TransportStats, check_prefix_mask, pack_rows, unpack_rows
from hybridrl.rollout.split.link import (
    Command,
    build_split_plan,
    handoff_bytes,
    recv_lengths,
    recv_rows,
)


def build_rollout_worker(cfg, groups, actor, tokenizer, split=None):
    """The worker of this placement (module docstring)."""
    if split is not None:
        return RemoteRollout(cfg, groups, actor, tokenizer, split)
    from hybridrl.rollout.worker import RolloutWorker

    return RolloutWorker(cfg, groups, actor, tokenizer)


@dataclasses.dataclass
class Results:
    """One request's generated batch as the training ranks know it: its prompts, the response
    lengths, the replicas' generation seconds, this rank's wait and the weight syncs the replicas
    had received; ``local``: the whole batch on this rank (a checkpoint's in-flight batch),
    else None (the rows wait on the generation ranks for a ``handoff``)."""

    prompts: list
    lens: list
    gen_s: float
    wait_s: float
    syncs: int
    local: GenerationOutput | None = None


class RemoteRollout:
    """The trainer's handle on the generation ranks (see module docstring)."""

    strategy = "split"
    engine = None

    def __init__(self, cfg, groups, actor, tokenizer, split):
        self.rank, self.groups, self.split = groups.rank, groups, split
        self.dtype = actor.config.params_dtype
        if self.rank == 0:
            box = [(actor.spec, actor.uses_te, self.dtype, groups.train)]
            dist.broadcast_object_list(box, src=0, group=split.command)
        self.sp = build_split_plan(groups.train, actor.spec, len(split.gen_ranks),
                                   split.gen_tp_size, cfg.reshard.bucket_mb, self.dtype,
                                   actor.uses_te, cfg.rollout.engine)
        self.plan, self.gen = self.sp.plan, self.sp.gen
        self.n_replicas = len(split.gen_replicas())
        self.sources = [members[0] for members in split.gen_replicas()]
        self.device = split.device()
        self.hand = split.handoff or split.bridge  # the batches' own communicator
        self.dp_of = [groups.train.coords(t)["dp"] for t in range(groups.train.world)]
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.outstanding = []  # (seed, prompts) requested, not yet collected, in request order
        self.kept = {}  # seed -> Results: collected, not yet used
        self.last_gen_s = self.last_wait_s = 0.0  # of the results generate_partitioned used
        self.last_syncs = 0
        self.last_command = "none yet"  # rank 0's last command (failure lines)
        self.verify = True
        self.timeout_s = cfg.rollout.timeout_s  # the wait for a batch (link.recv_lengths)

    def _command(self, cmd: Command) -> None:
        self.last_command = cmd.describe()
        if self.rank == 0:
            dist.broadcast_object_list([cmd], src=0, group=self.split.command)

    def who(self, src: int) -> str:
        """One generation replica in a failure line: rank, replica, rank 0's last command."""
        return (f"generation rank {src} (replica {self.sources.index(src)} of "
                f"{self.n_replicas}; last command: {self.last_command})")

    @torch.no_grad()
    def sync_weights(self, actor):
        """The actor's training shards -> every generation rank's engine (collective). The
        generation ranks take it after the batches requested before it (in command order), so
        their lengths are received first: every wait for a generation is then one bounded by
        rollout.timeout_s that names the replica (``collect``), never a bridge send that
        waits unbounded behind a batch being generated (async_steps >= 2, validation)."""
        self.collect()
        self._command(Command("sync"))
        named = {n: p.detach() for n, p in actor.module.named_parameters()}
        sources = train_sources(self.plan, self.rank, named)
        asm = Assembler(self.plan, self.rank, None, dtype=self.dtype)
        stats = run_plan(self.plan, self.rank, sources, asm, group=self.split.bridge,
                         verify=self.verify)
        self.verify = False
        return stats

    def release(self) -> None:
        """Nothing to give back: the engine lives on the generation ranks."""

    def sampling_params(self, max_new_tokens: int, temperature: float, top_k: int = -1,
                        top_p: float = 1.0) -> SamplingParams:
        return SamplingParams(max_new_tokens, temperature, top_k, top_p, self.eos_token_id,
                              self.pad_token_id)

    def in_flight(self) -> int:
        """Requests started and not yet used (outstanding or collected)."""
        return len(self.outstanding) + len(self.kept)

    def request(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> None:
        """Start generating ``prompts`` on the generation ranks; returns at once (up to
        ``rollout.async_steps`` requests may be outstanding)."""
        self._command(Command("gen", prompts, params, seed))
        self.outstanding.append((seed, prompts))

    def collect(self, seed: int | None = None) -> None:
        """Receive the lengths of the outstanding requests up to request ``seed`` (all of them
        when None), in request order (no-op without one)."""
        while self.outstanding and (seed is None or seed in (s for s, _ in self.outstanding)):
            t0 = time.perf_counter()
            s, prompts = self.outstanding.pop(0)
            lens, gen_s, syncs = recv_lengths(self.hand, self.sources, len(prompts),
                                              self.timeout_s, self.who, self.device)
            self.kept[s] = Results(prompts, lens, gen_s, time.perf_counter() - t0, syncs)
            if s == seed:
                break

    def _results(self, prompts, params, seed) -> Results:
        self.collect(seed)
        if seed not in self.kept or self.kept[seed].prompts != prompts:
            self.request(prompts, params, seed)
            self.collect(seed)
        res = self.kept.pop(seed)
        self.last_gen_s, self.last_wait_s, self.last_syncs = res.gen_s, res.wait_s, res.syncs
        return res

    def generate_partitioned(self, prompts: list[list[int]], params: SamplingParams, seed: int,
                             plan_parts) -> tuple[list[int], GenerationOutput, TransportStats]:
        """This DP replica's rows of the request's results (module docstring)."""
        res = self._results(prompts, params, seed)
        parts = plan_parts(res.lens)
        mine = parts[self.groups.dp_rank]
        stats = TransportStats(scalar_bytes=handoff_bytes(res.lens, [], self.n_replicas))
        if res.local is not None:  # a checkpoint's batch: every row is here
            idx = torch.tensor(mine, dtype=torch.long)
            out = res.local
            return mine, GenerationOutput(out.response_ids[idx], out.response_mask[idx],
                                          out.logprobs[idx]), stats
        self.collect()  # receive in the generation ranks' posting order (NCCL ignores tags)
        self._command(Command("handoff", seed=seed, parts=parts, dp_of=self.dp_of))
        local, stats.bytes_in = recv_rows(self.hand, self.sources, res.lens, mine,
                                          self.pad_token_id, self.timeout_s, self.who,
                                          self.device)
        return mine, local, stats

    # ------------------------------------------------------------------ in-flight batches
    def kept_state(self, seed: int) -> dict | None:
        """The results of request ``seed`` (collected first) as plain data, the whole batch on
        rank 0 (the generation ranks keep it for its hand-off); None if none. Collective."""
        self.collect()  # every length first: the generation ranks' posting order
        if seed not in self.kept:
            return None
        res = self.kept[seed]
        out = res.local
        if out is None:
            dp_of = [0] + [None] * (len(self.dp_of) - 1)
            everything = list(range(len(res.lens)))
            self._command(Command("handoff", seed=seed, parts=[everything], dp_of=dp_of,
                                  drop=False))
            if self.rank == 0:
                out, _ = recv_rows(self.hand, self.sources, res.lens, everything,
                                   self.pad_token_id, self.timeout_s, self.who, self.device)
        if out is None:
            return None  # not rank 0: only rank 0's state is written
        return {"seed": seed, "prompts": res.prompts, **kept_payload(out), "gen_s": res.gen_s,
                "wait_s": res.wait_s, "syncs": res.syncs}

    def keep(self, states: list[dict]) -> None:
        """Forget every kept result, then keep ``states``' (``kept_state``'s form). A forgotten
        result whose rows still wait on the generation ranks (a KL-guard rollback to a
        checkpoint at async_steps >= 1) is dropped there too: a handoff to no training rank."""
        self.collect()
        for seed, res in self.kept.items():
            if res.local is None:
                self._command(Command("handoff", seed=seed, parts=[],
                                      dp_of=[None] * len(self.dp_of), drop=True))
        self.kept = {}
        for state in states:
            out = kept_output(state, self.pad_token_id)
            self.kept[state["seed"]] = Results(state["prompts"], check_prefix_mask(out),
                                               state["gen_s"], state["wait_s"],
                                               state.get("syncs", 0), local=out)

    def close(self) -> None:
        """The generation ranks' loop ends (after any outstanding results are received)."""
        self.collect()
        self._command(Command("stop"))


def kept_payload(out: GenerationOutput) -> dict:
    """A batch's responses in the wire form ``kept_state`` stores (see ``kept_output``)."""
    lens = check_prefix_mask(out)
    rows = list(range(len(lens)))
    return {"lens": lens, "width": int(out.response_ids.shape[1]),
            "rows": pack_rows(rows, {r: r for r in rows}, out, lens).cpu()}


def kept_output(state: dict, pad_token_id: int) -> GenerationOutput:
    """``kept_state``'s batch as a right-padded ``GenerationOutput``: the wire form (``lens``,
    ``rows``: unpadded int32 ids then fp32 log-prob bits, ``width`` columns) or the padded
    int64 tensors of earlier checkpoints (``ids``, ``mask``, ``logprobs``)."""
    if "rows" not in state:
        return GenerationOutput(state["ids"], state["mask"], state["logprobs"])
    lens, width = [int(n) for n in state["lens"]], int(state["width"])
    ids = torch.full((len(lens), width), pad_token_id, dtype=torch.long)
    mask, logp = torch.zeros_like(ids), torch.zeros(len(lens), width, dtype=torch.float32)
    rows = list(range(len(lens)))
    unpack_rows(state["rows"], rows, lens, {r: r for r in rows}, ids, mask, logp)
    return GenerationOutput(ids, mask, logp)
