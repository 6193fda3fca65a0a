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
  generation and returns at once; ``collect()`` waits for the outstanding request's results
  (every training rank receives the whole batch from each gen replica, waiting at most
  ``rollout.timeout_s``: ``link.recv_shares``) and keeps them, with
  the replicas' generation seconds, the seconds this rank waited for them and the weight syncs
  the generation ranks had received when they generated them (``last_gen_s``, ``last_wait_s``,
  ``last_syncs``: those of the results ``generate_partitioned`` used last).
  ``generate_partitioned(prompts, params, seed, plan_parts)`` uses kept results of the same
  request, else collects an outstanding one, requests and collects; then
  ``plan_parts(lengths)`` -> rows per DP rank, and returns this DP rank's rows (row order and
  right padding as ``RolloutWorker.generate_partitioned``: the same tensors).
- ``kept_state(seed)`` / ``keep(state)``: request ``seed``'s results (collected first) as plain
  data and back (the in-flight batch a checkpoint holds). Results are kept per request, so a
  validation generated between a prefetch and its use does not displace the prefetched batch.
- ``close()`` (every training rank; rank 0 says ``stop``): the generation loop ends.
- No collective on the default group: rank 0 <-> generation ranks on the command group, every
  training rank <-> generation ranks on the bridge, point to point.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridrl.reshard.assemble import Assembler
from hybridrl.reshard.executor import run_plan, train_sources
from hybridrl.rollout.base import GenerationOutput, SamplingParams
from hybridrl.rollout.partition import TransportStats, check_prefix_mask
from hybridrl.rollout.split.link import Command, build_split_plan, recv_shares


def build_rollout_worker(cfg, groups, actor, tokenizer, split=None):
    """The worker of this placement (module docstring)."""
    if split is not None:
        return RemoteRollout(cfg, groups, actor, tokenizer, split)
    from hybridrl.rollout.worker import RolloutWorker

    return RolloutWorker(cfg, groups, actor, tokenizer)


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
                                   actor.uses_te)
        self.plan, self.gen = self.sp.plan, self.sp.gen
        self.n_replicas = len(split.gen_replicas())
        self.sources = [members[0] for members in split.gen_replicas()]
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.outstanding = None  # (seed, prompts) requested, not yet collected
        self.kept = {}  # seed -> (prompts, GenerationOutput, gen s, wait s, syncs): not yet used
        self.last_gen_s = self.last_wait_s = 0.0  # of the results generate_partitioned used
        self.last_syncs = 0
        self.verify = True
        self.timeout_s = cfg.rollout.timeout_s  # the wait for a batch (link.recv_shares)

    def _command(self, cmd: Command) -> None:
        if self.rank == 0:
            dist.broadcast_object_list([cmd], src=0, group=self.split.command)

    @torch.no_grad()
    def sync_weights(self, actor):
        """The actor's training shards -> every generation rank's engine (collective)."""
        self.collect()  # a generation in flight finishes on the weights it started with
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

    def request(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> None:
        """Start generating ``prompts`` on the generation ranks; returns at once."""
        self.collect()
        self._command(Command("gen", prompts, params, seed))
        self.outstanding = (seed, prompts)

    def collect(self) -> None:
        """Wait for the outstanding request's results (no-op without one)."""
        if self.outstanding is None:
            return
        t0 = time.perf_counter()
        out, gen_s, syncs = recv_shares(self.split.bridge, self.sources, len(self.outstanding[1]),
                                 self.pad_token_id, self.timeout_s)
        seed, prompts = self.outstanding
        self.kept[seed] = (prompts, out, gen_s, time.perf_counter() - t0, syncs)
        self.outstanding = None

    def _results(self, prompts, params, seed) -> GenerationOutput:
        self.collect()
        if seed not in self.kept or self.kept[seed][0] != prompts:
            self.request(prompts, params, seed)
            self.collect()
        _, out, self.last_gen_s, self.last_wait_s, self.last_syncs = self.kept.pop(seed)
        return out

    def generate_partitioned(self, prompts: list[list[int]], params: SamplingParams, seed: int,
                             plan_parts) -> tuple[list[int], GenerationOutput, TransportStats]:
        """This DP replica's rows of the request's results (module docstring)."""
        out = self._results(prompts, params, seed)
        lens = check_prefix_mask(out)
        parts = plan_parts(lens)
        mine = parts[self.groups.dp_rank]
        idx = torch.tensor(mine, dtype=torch.long)
        local = GenerationOutput(out.response_ids[idx], out.response_mask[idx], out.logprobs[idx])
        received = sum(8 * (1 + 3 * out.response_ids.shape[1]) for _ in lens) + 24 * len(self.sources)
        return mine, local, TransportStats(bytes_in=received)

    # ------------------------------------------------------------------ in-flight batch
    def kept_state(self, seed: int) -> dict | None:
        """The results of request ``seed`` (collected first), as plain data; None if none."""
        self.collect()
        if seed not in self.kept:
            return None
        prompts, out, gen_s, wait_s, syncs = self.kept[seed]
        return {"seed": seed, "prompts": prompts, "ids": out.response_ids,
                "mask": out.response_mask, "logprobs": out.logprobs, "gen_s": gen_s,
                "wait_s": wait_s, "syncs": syncs}

    def keep(self, state: dict | None) -> None:
        """Forget every kept result, then keep ``state``'s (``kept_state``'s form)."""
        self.collect()
        self.kept = {}
        if state is not None:
            self.kept[state["seed"]] = (state["prompts"], GenerationOutput(
                state["ids"], state["mask"], state["logprobs"]), state["gen_s"], state["wait_s"],
                state.get("syncs", 0))

    def close(self) -> None:
        """The generation ranks' loop ends (after any outstanding results are received)."""
        self.collect()
        self._command(Command("stop"))
