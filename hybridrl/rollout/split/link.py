"""The wire between training ranks and generation ranks of a split placement.

Contract (shared by ``rollout.split.remote`` on the training ranks and ``rollout.split.server`` on the
generation ranks; every function here is called on both sides with the same arguments):
- ``build_split_plan(train, spec, gen_world, gen_tp, bucket_mb, dtype, uses_te)`` -> ``SplitPlan``:
  the placements (``split_placements``: training layout on ranks 0..T-1, gen replicas of gen_tp
  consecutive ranks after them, builtin engine vocab padding = training's) and the ``split``
  reshard plan (pure, the same on every rank).
- ``Command``: what rank 0 tells the generation ranks (``broadcast_object_list`` over the command
  group ``{0} + generation ranks``): ``sync`` (every rank then runs the plan over the bridge),
  ``gen`` (prompts, sampling params, seed: each gen replica samples its ``array_split`` share,
  request i with seed ``request_seed(seed, i)``, so a sample does not depend on the number of
  replicas' boundaries beyond the share cut, exactly as the colocated worker does), ``stop``.
- ``send_share(bridge, train_ranks, rows, out, gen_s, syncs)`` (a replica's first gen TP rank) /
  ``recv_shares(bridge, sources, n_rows, pad, timeout_s)`` (every training rank): each replica's rows travel
  as one float64 tensor [rows, 1 + 3R] (row index, ids, mask, log-probs; exact for ids < 2^53)
  after an int64 header (rows, R, generation microseconds, ``syncs``: the weight syncs the
  replica had received when it generated, i.e. which weights made the batch), point to point to every training
  rank, tag ``RESULT_TAG``. ``recv_shares`` returns the whole batch in prompt order, right
  padded to R = the longest response (pad id, mask 0, log-prob 0 past each length), the
  longest generation time of the replicas and the fewest syncs of the replicas. Every receive waits at most ``timeout_s`` (the
  trainer passes ``rollout.timeout_s``, the generation timeout, not the bridge's collective
  timeout: a batch may take longer to generate than a training step plus the collective
  timeout); past it, ``GenerationTimeout`` (one line naming the generation rank and the knob).
  A generation rank whose process is gone fails the receive at once (its connection closes),
  named by the entrypoint's phase board. (gloo closes a pair on a timed-out receive, so the
  wait is one bounded wait, not a loop of short ones.)
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

from hybridrl.reshard.placement import split_placements
from hybridrl.reshard.planner import SPLIT, Plan, plan_reshard
from hybridrl.reshard.specs import LlamaShape, build_specs
from hybridrl.rollout.base import GenerationOutput

RESULT_TAG = 1 << 20


class GenerationTimeout(RuntimeError):
    """No generated batch within ``rollout.timeout_s`` (its own line, not a collective's)."""


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    shape: LlamaShape
    plan: Plan

    @property
    def gen(self):
        return self.plan.gen


@dataclasses.dataclass(frozen=True)
class Command:
    op: str  # "sync" | "gen" | "stop"
    prompts: list | None = None
    params: object = None
    seed: int = 0


def build_split_plan(train, spec, gen_world: int, gen_tp: int, bucket_mb: int, dtype,
                     uses_te: bool) -> SplitPlan:
    """The split reshard plan of a training layout and its generation ranks (pure)."""
    shape = LlamaShape.from_model(spec)
    train_pl, gen_pl = split_placements(train, shape, gen_world, gen_tp, 1, vocab_pad=None)
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan = plan_reshard(train_pl, gen_pl, build_specs(shape, "te" if uses_te else "local"), SPLIT,
                        bucket_mb, itemsize)
    return SplitPlan(shape, plan)


def send_share(bridge, train_ranks, rows: list[int], out: GenerationOutput | None,
               gen_s: float, syncs: int = 0) -> list:
    """Post this replica's rows to every training rank; returns the works to wait on."""
    r = out.response_ids.shape[1] if rows else 0
    header = torch.tensor([len(rows), r, int(gen_s * 1e6), syncs], dtype=torch.long)
    works = [dist.isend(header, dst, group=bridge, tag=RESULT_TAG) for dst in train_ranks]
    if rows:
        packed = torch.empty(len(rows), 1 + 3 * r, dtype=torch.float64)
        packed[:, 0] = torch.tensor(rows, dtype=torch.float64)
        for k, t in enumerate((out.response_ids, out.response_mask, out.logprobs)):
            packed[:, 1 + k * r:1 + (k + 1) * r] = t.cpu().to(torch.float64)
        works += [dist.isend(packed, dst, group=bridge, tag=RESULT_TAG + 1) for dst in train_ranks]
    return works


def recv_shares(bridge, sources, n_rows: int, pad: int,
                timeout_s: float) -> tuple[GenerationOutput, float, int]:
    """Every replica's rows, in prompt order (see module docstring); (batch, generation s,
    syncs)."""
    limit = datetime.timedelta(seconds=timeout_s)

    def wait(work, src):
        try:
            work.wait(limit)
        except RuntimeError as err:
            if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                raise
            raise GenerationTimeout(
                f"no generated batch from generation rank {src} within rollout.timeout_s="
                f"{timeout_s:g} s (its replica is generating too slowly or is stuck; raise "
                f"rollout.timeout_s for long outputs)") from None

    headers = [torch.empty(4, dtype=torch.long) for _ in sources]
    for w, src in [(dist.irecv(h, src, group=bridge, tag=RESULT_TAG), src)
                   for h, src in zip(headers, sources)]:
        wait(w, src)
    parts = []
    for h, src in zip(headers, sources):
        n, r = int(h[0]), int(h[1])
        if n:
            buf = torch.empty(n, 1 + 3 * r, dtype=torch.float64)
            parts.append((dist.irecv(buf, src, group=bridge, tag=RESULT_TAG + 1), buf, r, src))
    lens = torch.zeros(n_rows, dtype=torch.long)
    for w, buf, r, src in parts:
        wait(w, src)
        lens[buf[:, 0].long()] = buf[:, 1 + r:1 + 2 * r].sum(-1).long()
    width = max(1, int(lens.max())) if n_rows else 1
    ids = torch.full((n_rows, width), pad, dtype=torch.long)
    mask = torch.zeros(n_rows, width, dtype=torch.long)
    logp = torch.zeros(n_rows, width, dtype=torch.float32)
    for _, buf, r, _ in parts:
        idx, w = buf[:, 0].long(), min(r, width)
        ids[idx, :w] = buf[:, 1:1 + w].long()
        mask[idx, :w] = buf[:, 1 + r:1 + r + w].long()
        logp[idx, :w] = buf[:, 1 + 2 * r:1 + 2 * r + w].float()
    valid = mask.bool()
    ids = torch.where(valid, ids, torch.full_like(ids, pad))
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    gen_s = max((float(h[2]) / 1e6 for h in headers), default=0.0)
    syncs = min((int(h[3]) for h in headers), default=0)
    return GenerationOutput(ids, mask, logp), gen_s, syncs
