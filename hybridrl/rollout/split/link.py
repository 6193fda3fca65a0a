"""The wire between training ranks and generation ranks of a split placement.

Contract (shared by ``rollout.split.remote`` on the training ranks and ``rollout.split.server``
on the generation ranks; every function here is called on both sides with the same arguments):
- ``build_split_plan(train, spec, gen_world, gen_tp, bucket_mb, dtype, uses_te, engine)`` ->
  ``SplitPlan``: the placements (``split_placements``: training layout on ranks 0..T-1, gen
  replicas of gen_tp consecutive ranks after them; vocabulary padding: the builtin engine's =
  training's, SGLang's 64) and the ``split`` reshard plan (pure, the same on every rank).
- ``Command``: what rank 0 tells the generation ranks (``broadcast_object_list`` over the command
  group ``{0} + generation ranks``): ``sync`` (every rank then runs the plan over the bridge),
  ``gen`` (prompts, sampling params, seed: each gen replica samples its ``replica_rows`` share,
  request i with seed ``request_seed(seed, i)``, exactly as the colocated worker does),
  ``handoff`` (seed, ``parts``: the global rows of each DP replica, ``dp_of``: each training
  rank's DP replica or None, ``drop``: the generated batch of request ``seed`` goes to the
  training ranks, each only its replica's rows; ``drop``: the generation replica forgets the
  batch afterwards, else it keeps it for a later hand-off), ``stop``. ``Command.describe()``: the one-line form
  failure lines quote as a replica's last command.
- The hand-off, in two parts. After generating, a replica's first rank posts to every training
  rank ``send_lengths``: an int64 header (rows, generation microseconds, ``syncs``: the weight
  syncs the replica had received when it generated, i.e. which weights made the batch) and one
  int32 length per row, tag ``LENGTH_TAG``; every training rank ``recv_lengths`` (each
  replica's header and lengths, in request order) -> the whole batch's response lengths, the
  longest generation time and the fewest syncs of the replicas. The trainer then cuts the rows
  over its DP replicas from the lengths (``plan_parts``) and rank 0 sends ``handoff``;
  ``send_rows`` (the replica's first rank) posts each destination one flat int32 buffer (the
  valid token ids of its rows in ascending order, then their fp32 log-probs' bits:
  ``hybridrl.rollout.partition``'s packing; no padding, no float64, nothing for a destination
  with no row of this replica), tag ``ROWS_TAG``; ``recv_rows`` (a training rank) -> its rows
  as a ``GenerationOutput`` [rows, R] (R = the batch's longest response, pad id / mask 0 /
  log-prob 0 past each length) and the bytes it received. ``handoff_bytes(lens, mine,
  n_replicas)`` is the bytes a training rank receives for a batch (lengths plus its rows),
  computed from the lengths alone (pure).
- Every receive of a training rank waits at most ``timeout_s`` (the trainer passes
  ``rollout.timeout_s``, the generation timeout, not the bridge's collective timeout: a batch
  may take longer to generate than a training step plus the collective timeout); past it,
  ``GenerationTimeout``: one line naming the generation rank, its replica and the last command
  rank 0 sent (``who``) and the knob. A receive that fails otherwise (the generation rank's
  process is gone: its connection closes at once) is the same one-line error, saying so.
  (gloo closes a pair on a timed-out receive, so the wait is one bounded wait, not a loop of
  short ones.)
"""

from __future__ import annotations

import dataclasses
import datetime

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.reshard.planner import Plan
from hybridrl.reshard.specs import LlamaShape
from hybridrl.rollout.base import GenerationOutput
from hybridrl.rollout.partition import pack_rows, unpack_rows

LENGTH_TAG = 1 << 20
ROWS_TAG = LENGTH_TAG + 1
HEADER = 3  # int64: rows, generation microseconds, syncs


class GenerationTimeout(RuntimeError):
    """No generated batch (or rows) within ``rollout.timeout_s``, or a generation rank lost:
    one line naming the rank, its replica and its last command, not a collective's."""


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    shape: LlamaShape
    plan: Plan

    @property
    def gen(self):
        return self.plan.gen


@dataclasses.dataclass(frozen=True)
class Command:
    op: str  # "sync" | "gen" | "handoff" | "stop"
    prompts: list | None = None
    params: object = None
    seed: int = 0
    parts: list | None = None  # handoff: global rows of each DP replica
    dp_of: list | None = None  # handoff: each training rank's DP replica (None: no rows)
    drop: bool = True  # handoff: forget the batch afterwards

    def describe(self) -> str:
        if self.op == "gen":
            return f"gen (request seed {self.seed}, {len(self.prompts or [])} prompts)"
        if self.op == "handoff":
            return f"handoff (request seed {self.seed})"
        return self.op


def replica_rows(n_rows: int, n_replicas: int) -> list[list[int]]:
    """The global rows each gen replica samples (contiguous ``numpy.array_split`` shares)."""
    return [[int(i) for i in s] for s in np.array_split(np.arange(n_rows), n_replicas)]


def build_split_plan(train, spec, gen_world: int, gen_tp: int, bucket_mb: int, dtype,
                     uses_te: bool, engine: str = "builtin") -> SplitPlan:
    """The split reshard plan of a training layout and its generation ranks for ``engine``
    (its vocabulary padding: ``rollout.split.engine.engine_split_plan``; pure)."""
    from hybridrl.rollout.split.engine import engine_split_plan

    shape = LlamaShape.from_model(spec)
    return SplitPlan(shape, engine_split_plan(engine, train, shape, gen_world, gen_tp, bucket_mb,
                                              dtype, uses_te))


def handoff_bytes(lens: list[int], mine: list[int], n_replicas: int) -> int:
    """Bytes a training rank receives for one batch: every replica's header and int32 lengths,
    then 8 bytes (int32 id + fp32 log-prob) per valid token of its own rows (pure)."""
    return 8 * HEADER * n_replicas + 4 * len(lens) + 8 * sum(int(lens[i]) for i in mine)


# ------------------------------------------------------------------ generation side
def send_lengths(bridge, train_ranks, out: GenerationOutput | None, gen_s: float,
                 syncs: int, device="cpu") -> list:
    """Post the replica's header and row lengths to every training rank; the works to wait.
    ``device``: where tensors crossing the bridge live (``SplitGroups.device()``)."""
    lens = (out.response_mask.sum(-1).to(device, torch.int32) if out is not None
            else torch.empty(0, dtype=torch.int32, device=device))
    header = torch.tensor([len(lens), int(gen_s * 1e6), syncs], dtype=torch.long, device=device)
    works = [dist.isend(header, dst, group=bridge, tag=LENGTH_TAG) for dst in train_ranks]
    if len(lens):
        works += [dist.isend(lens, dst, group=bridge, tag=LENGTH_TAG) for dst in train_ranks]
    return works


def send_rows(bridge, rows: list[int], out: GenerationOutput | None, parts: list,
              dp_of: list, device="cpu") -> list:
    """Post each training rank t the rows of ``parts[dp_of[t]]`` this replica holds (module
    docstring); the works to wait on."""
    position = {row: j for j, row in enumerate(rows)}
    lens = [int(v) for v in out.response_mask.sum(-1)] if out is not None else []
    by_row = {row: lens[j] for row, j in position.items()}
    packed = {}  # DP replica -> its buffer (the same for each of its ranks)
    works = []
    for dst, d in enumerate(dp_of):
        if d is None:
            continue
        if d not in packed:
            packed[d] = pack_rows([r for r in parts[d] if r in position], position, out,
                                  by_row).to(device)
        if packed[d].numel():
            works.append(dist.isend(packed[d], dst, group=bridge, tag=ROWS_TAG))
    return works


# ------------------------------------------------------------------ training side
def _wait(work, src: int, timeout_s: float, who) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        text = str(err).lower()
        line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if "timed out" in text or "timeout" in text:
            raise GenerationTimeout(
                f"no generated batch from {who(src)} within rollout.timeout_s={timeout_s:g} s "
                f"(its replica is generating too slowly or is stuck; raise rollout.timeout_s for "
                f"long outputs)") from None
        raise GenerationTimeout(f"{who(src)} is gone: the receive from it failed ({line})") \
            from None


def _default_who(src: int) -> str:
    return f"generation rank {src}"


def recv_lengths(bridge, sources: list[int], n_rows: int, timeout_s: float,
                 who=_default_who, device="cpu") -> tuple[list[int], float, int]:
    """(the batch's response lengths in prompt order, generation s, syncs); see the docstring."""
    shares = replica_rows(n_rows, len(sources))
    headers = [torch.empty(HEADER, dtype=torch.long, device=device) for _ in sources]
    for h, src in zip(headers, sources):
        _wait(dist.irecv(h, src, group=bridge, tag=LENGTH_TAG), src, timeout_s, who)
    lens = [0] * n_rows
    for h, src, share in zip(headers, sources, shares):
        n = int(h[0])
        if n != len(share):
            raise RuntimeError(f"{who(src)} sent {n} rows for a share of {len(share)}")
        if n:
            buf = torch.empty(n, dtype=torch.int32, device=device)
            _wait(dist.irecv(buf, src, group=bridge, tag=LENGTH_TAG), src, timeout_s, who)
            for row, v in zip(share, buf.tolist()):
                lens[row] = int(v)
    headers = [h.cpu() for h in headers]
    gen_s = max((float(h[1]) / 1e6 for h in headers), default=0.0)
    syncs = min((int(h[2]) for h in headers), default=0)
    return lens, gen_s, syncs


def recv_rows(bridge, sources: list[int], lens: list[int], mine: list[int], pad: int,
              timeout_s: float, who=_default_who, device="cpu") -> tuple[GenerationOutput, int]:
    """This rank's rows ``mine`` (ascending global rows) after a ``handoff``; (rows, bytes)."""
    shares = replica_rows(len(lens), len(sources))
    owner = {row: src for src, share in zip(sources, shares) for row in share}
    width = max(1, max(lens, default=0))
    ids = torch.full((len(mine), width), pad, dtype=torch.long)
    mask = torch.zeros(len(mine), width, dtype=torch.long)
    logp = torch.zeros(len(mine), width, dtype=torch.float32)
    local = {row: j for j, row in enumerate(mine)}
    posted, received = [], 0
    for src in sources:
        rows = [r for r in mine if owner[r] == src]
        total = sum(lens[r] for r in rows)
        if total:
            buf = torch.empty(2 * total, dtype=torch.int32, device=device)
            posted.append((dist.irecv(buf, src, group=bridge, tag=ROWS_TAG), buf, rows, src))
            received += 8 * total
    for work, buf, rows, src in posted:
        _wait(work, src, timeout_s, who)
        unpack_rows(buf, rows, lens, local, ids, mask, logp)
    return GenerationOutput(ids, mask, logp), received
