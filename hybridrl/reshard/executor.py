"""Run a reshard ``Plan`` with torch.distributed, bucket by bucket, overlapping comm and consume.

Contract:
- ``run_plan(plan, sources, assembler, group=None)`` (or ``run_plan(plan, rank, sources,
  assembler, ...)``) must be called on every rank of the plan's world with the same plan.
  ``sources`` maps each parameter key this rank holds to ``(canonical_view, lo)``: its training
  piece in the canonical layout and the first canonical row it holds (``train_sources(plan,
  named)`` builds it from megatron's named tensors). ``rank`` defaults to this process's rank in
  ``group``; an explicit one that is not that rank is a wrong input like any other (below).
- ``train_sources`` raises nothing for a wrong input: a training tensor the shape description
  does not match (missing, shaped otherwise than its spec's local piece: e.g. a vocabulary padded
  to another divisor, another ffn or number of KV groups; a layer past the stage's share), or a
  wrong ``rank``, is kept in the returned ``Sources.error`` and reported by ``run_plan``'s
  agreement, so every rank raises the same one line naming the tensor and both shapes, before
  any transfer.
- Phases (``hybridrl.reshard.schedule.phase_schedule``, derived from the plan alone): this
  rank's first bucket is posted, then the local phases -L..-1 copy its local-only chunks (each
  at most one bucket of rows, or one larger parameter), then its buckets. Bucket k+1's sends and
  receives are posted (``batch_isend_irecv``, tag = bucket index) before the assembler handles
  bucket k, so the next bucket's communication overlaps the current bucket's copy/convert/load;
  when the assembler receives in place (``into=``), every later bucket that needs no temporary
  buffer (all its sends contiguous views, all its receives landing in their slots) is posted
  too, up to the first that does: such buckets hold no memory in flight, and one long run of
  posted transfers is what the wire does fastest (every rank posts in ascending bucket order);
  bucket k's deliveries are followed by the local rows of the parameters it completes. Every
  phase ends with one ``assembler.flush()`` (L local flushes on every rank, empty ones included,
  then one per bucket this rank sends or receives in). So at most two buckets' buffers are alive
  and one flush emits at most about one bucket (the planner charges a parameter's local rows to
  its last receiving bucket); the full model is never built on a rank (unless the strategy's
  destination is the full model: the allgather/vanilla baselines).
- One isend/irecv per message, of flat 1-D contiguous tensors (gloo: no 2-D all_gather outputs,
  no uneven all_gather). A message is one transfer, or, with ``merges`` (agreed once by
  ``hybridrl.reshard.coalesce.agree``), several transfers between the same two ranks that lie in
  memory as agreed on both sides (one flat view over them). A contiguous piece is sent as a
  view, a contiguous destination slot is received into directly; other pieces (and a merged
  message whose memory no longer lies as agreed) go through a temporary buffer. Every strategy
  runs this way: zero_redundancy's micro-DP "all-gather" is p2p exchanges inside the micro-DP
  group and the allgather baseline is a p2p emulation of an all_gather; no collective moves
  weights (the only collective is the ``verify`` check below).
- ``verify=True`` (default) first checks with one small all_gather_object that every rank runs
  the same plan (``plan_fingerprint``) and that no rank's inputs are wrong (its rank and the
  group's size, every training tensor's presence and shape, the sources' dtype vs itemsize,
  the assembler's rank and dtype, every ``into=`` target's name/shape/dtype), so a mismatch
  raises ValueError on all ranks instead of hanging. Verify once per plan; reruns of a verified
  plan may pass ``verify=False`` (a wrong input then raises on its own rank only).
- ``run_plan_local(plan, sources_by_rank, assemblers)`` plays every rank in one process, phase by
  phase in the same order (tests); returns each rank's peak ``assembler.live_bytes``.
- Returns ``RunStats``: bytes of the send / receive buffers this rank posted to isend / irecv
  (not wire traffic; merged messages include the holes they run through), number of buckets,
  messages posted (isends + irecvs) and, measured before every flush, the peak live bytes
  (comm buffers + ``assembler.live_bytes``: assembling regions + emitted canonical bytes not yet
  flushed or kept), the peak comm buffer bytes and the peak ``assembler.live_bytes``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hybridrl.reshard.assemble import Assembler
from hybridrl.reshard.coalesce import Merges, message_numel, message_view, singles
from hybridrl.reshard.coalesce import source_piece as _piece
from hybridrl.reshard.planner import Plan, Transfer
from hybridrl.reshard.schedule import local_phases, phase_schedule
from hybridrl.reshard.specs import ParamSpec, canonical_view


@dataclasses.dataclass(frozen=True)
class RunStats:
    """What one ``run_plan`` posted on this rank (module doc): send / receive buffer bytes,
    buckets taken part in, peak live bytes (comm buffers + assembler), peak comm buffer bytes,
    peak ``assembler.live_bytes`` and messages posted (isends + irecvs)."""

    bytes_sent: int
    bytes_received: int
    buckets: int
    peak_live_bytes: int
    peak_comm_bytes: int
    peak_assembler_bytes: int = 0
    messages: int = 0


class Sources(dict):
    """``key -> (canonical view, first row)`` of this rank's training pieces (``train_sources``),
    with ``error``: the first wrong input found (None: none), which ``run_plan`` reports on
    every rank through its agreement instead of raising on this rank alone."""

    error: str | None = None


def group_rank(rank: int | None, group: ProcessGroup | None = None) -> tuple[int, str | None]:
    """(the rank to run as, a wrong-input line or None). ``rank=None``: this process's rank in
    ``group`` (torch.distributed must be initialized); an explicit rank must be that rank when
    it is."""
    if not dist.is_available() or not dist.is_initialized():
        if rank is None:
            raise ValueError("rank= is needed when torch.distributed is not initialized")
        return rank, None
    mine = dist.get_rank(group)
    if rank is None:
        return mine, None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank != mine:
        return mine, (f"rank={rank!r} was passed but this process is rank {mine} of the "
                      f"process group ({dist.get_world_size(group)} ranks); leave rank= out "
                      "to use the group's rank")
    return rank, None


_HINTS = {"vocab": "the vocabulary's rows per TP rank: check vocab and "
                   "make_vocab_size_divisible_by",
          "qkv": "check num_query_groups, heads, head_dim and hidden",
          "fc1": "check ffn and hidden", "row": "check hidden, ffn and heads x head_dim",
          "norm": "check hidden and head_dim"}


def _shape_error(spec: ParamSpec, name: str, got: tuple, want: tuple, vocab_chunk: int) -> str:
    hint = _HINTS[spec.kind]
    if spec.kind == "vocab":
        hint = f"{vocab_chunk} = {hint}"
    return (f"training tensor {name!r} has shape {got} but the reshard's shape description "
            f"gives {want} ({hint})")


def _layer_error(plan: Plan, rank: int, named: Mapping) -> str | None:
    """A training tensor of a layer past this stage's share (the description has fewer layers
    per stage than the model), or None."""
    t = plan.train
    per_stage = t.num_layers // t.pp
    for name in named:
        m = re.match(r"(?:module\.)*decoder\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= per_stage:
            return (f"training tensor {name!r} is layer {m.group(1)} of its stage but the "
                    f"reshard's shape description gives {per_stage} layers per stage "
                    f"(layers={t.num_layers}, pp={t.pp}): check layers")
    return None


@overload
def train_sources(plan: Plan, named: Mapping[str, torch.Tensor], *, rank: int | None = None,
                  group: ProcessGroup | None = None) -> Sources: ...
@overload
def train_sources(plan: Plan, rank: int | None, named: Mapping[str, torch.Tensor], *,
                  group: ProcessGroup | None = None) -> Sources: ...
def train_sources(plan: Plan, *args: Any, rank: int | None = None,  # noqa: E302
                  group: ProcessGroup | None = None) -> Sources:
    """``Sources`` (key -> (canonical view, first row)) from this rank's megatron tensors
    ``named`` (stage-local names, e.g. ``dict(model.named_parameters())``).

    ``train_sources(plan, named)`` or ``train_sources(plan, rank, named)``; ``rank`` defaults
    to this process's rank in ``group``. A missing or wrongly shaped tensor (its spec's local
    piece: ``storage_shape``) or a wrong ``rank`` is not raised here but kept in ``.error`` for
    ``run_plan`` to report on every rank (module doc)."""
    if len(args) == 2:
        rank, named = args
    elif len(args) == 1:
        (named,) = args
    else:
        raise TypeError("train_sources(plan, named) or train_sources(plan, rank, named)")
    if not isinstance(named, Mapping):
        raise TypeError(f"named must map megatron names to tensors, got {type(named).__name__}")
    rank, error = group_rank(rank, group)
    out = Sources()
    t = plan.train
    if error is None and not 0 <= rank < t.world:
        error = f"rank {rank} is outside the plan's {t.world} ranks"
    if error is None and t.coords[rank] is not None:
        error = _layer_error(plan, rank, named)
    for spec in plan.specs if error is None else ():
        iv = t.interval(spec, rank)
        if iv is None or iv[1] <= iv[0]:
            continue
        name = t.local_name(spec)
        if name not in named:
            error = (f"missing training tensor {name!r} (the model has no tensor of this name "
                     "on this rank's stage: check the shape description and naming)")
            break
        tensor = named[name]
        want = t.storage_shape(spec)
        if tuple(tensor.shape) != want:
            error = _shape_error(spec, name, tuple(tensor.shape), want, t.vocab_chunk)
            break
        out[spec.key] = (canonical_view(spec, tensor, iv[1] - iv[0]), iv[0])
    out.error = error
    return out


class _Bucket:
    """One bucket's operations on this rank: one isend / irecv per message, in posting order.

    A message is one transfer, or several merged by ``merges`` (``hybridrl.reshard.coalesce``).
    Built unposted (``temp_bytes`` then says what posting it would allocate); ``post()`` issues
    them. A send whose pieces are one contiguous run of memory goes out as a view (no copy); a
    receive lands directly in the assembler's buffers when their slots are one contiguous run,
    else in a temporary buffer (a merged message whose memory moved since it was agreed packs /
    unpacks through one).
    """

    def __init__(self, plan, sources, sends, recvs, tag, group, assembler, merges=None):
        self.plan, self.tag, self.group, self.assembler = plan, tag, group, assembler
        split = merges.groups if merges is not None else (lambda k, ts: singles(ts))
        spare = assembler.spare or (lambda view: 0)
        self.sends = []
        for ts, gaps in split(tag, sends):
            pieces = [_piece(plan, sources, t) for t in ts]
            self.sends.append((ts, gaps, pieces, message_view(pieces, gaps)))
        self.landing = []
        for ts, gaps in split(tag, recvs):
            slots = [assembler.slot(t.key, t.lo, t.hi) for t in ts]
            whole = all(x is not None for x in slots)
            self.landing.append((ts, gaps, message_view(slots, gaps, spare) if whole else None))
        size = plan.itemsize
        self.temp_bytes = sum(message_numel(ts, gaps, size) * size
                              for ts, gaps, *rest in self.sends + self.landing if rest[-1] is None)
        self.sent_bytes = sum(message_numel(ts, gaps, size) * size for ts, gaps, *_ in self.sends)
        self.recv_bytes = sum(message_numel(ts, gaps, size) * size for ts, gaps, _ in self.landing)
        self.messages = len(self.sends) + len(self.landing)
        self.works = None

    def post(self) -> _Bucket:
        ops, group, tag, asm = [], self.group, self.tag, self.assembler
        self.posted = []  # (is send, flat tensor, peer): what a Replay re-posts
        for ts, gaps, pieces, flat in self.sends:
            if flat is None:  # not laid out as agreed (or not contiguous): pack
                flat = torch.cat([x.reshape(-1) for x in _with_gaps(pieces, gaps)])
            ops.append(dist.P2POp(dist.isend, flat, ts[0].dst, group, tag))
            self.posted.append((True, flat, ts[0].dst))
        self.temps = {}  # message index -> temporary buffer (its slots are not laid out as agreed)
        for i, (ts, gaps, flat) in enumerate(self.landing):
            if flat is None:
                flat = self.temps[i] = torch.empty(message_numel(ts, gaps, self.plan.itemsize),
                                                   dtype=asm.dtype, device=asm.device)
            ops.append(dist.P2POp(dist.irecv, flat, ts[0].src, group, tag))
            self.posted.append((False, flat, ts[0].src))
        self.sends = None
        self.works = dist.batch_isend_irecv(ops) if ops else []
        return self

    def wait_and_deliver(self, plan: Plan, assembler: Assembler) -> None:
        for w in self.works:
            w.wait()
        for i, (ts, gaps, _) in enumerate(self.landing):
            buf, at = self.temps.get(i), 0  # buf None: already where it lives
            for t, gap in zip(ts, (*gaps, 0)):
                n = t.nbytes // plan.itemsize
                assembler.accept(t.key, t.lo, t.hi, None if buf is None else
                                 buf.narrow(0, at, n).view(plan.spec(t.key).piece_shape(t.hi - t.lo)))
                at += n + gap


def _with_gaps(pieces, gaps):
    """The pieces with zero-filled holes between them (a merged message packed by copy)."""
    for piece, gap in zip(pieces, (*gaps, 0)):
        yield piece
        if gap:
            yield piece.new_zeros(gap)


def plan_fingerprint(plan: Plan) -> tuple:
    """Small summary every rank of one reshard must share (layouts, model depth and tensor
    count, strategy, buckets, bytes)."""
    g, t = plan.gen, plan.train
    return (plan.strategy, t.world, t.tp, t.pp, g.tp, g.pp, g.grouping, g.vocab_chunk,
            t.num_layers, len(plan.specs), plan.itemsize, len(plan.buckets),
            sum(x.nbytes for b in plan.buckets for x in b))


def check_same_plan(plan: Plan, group=None, local_error: str | None = None,
                    merged: str | None = None) -> None:
    """One all_gather_object: ValueError on every rank unless all ranks run the same plan, all
    in the same messages phase (``merged``: None = one message per transfer, "agree" = about to
    agree on merged messages, "run" = running agreed ones), and none reports a ``local_error`` (so a
    bad input on one rank fails all, never hangs)."""
    mine = (plan_fingerprint(plan), merged)
    seen: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (mine, local_error), group=group)
    errors = [(i, err) for i, (_, err) in enumerate(seen) if err]
    if errors:
        raise ValueError(f"group rank {errors[0][0]}: {errors[0][1]}")
    bad = [i for i, (other, _) in enumerate(seen) if other != mine]
    if bad:
        raise ValueError(f"ranks disagree on the reshard plan: this rank has {mine}, "
                         f"group rank {bad[0]} has {seen[bad[0]][0]}")


def _sources_error(plan: Plan, rank: int, sources: Mapping) -> str | None:
    """A source piece the plan cannot use (missing, or not its spec's canonical piece), or
    None: checks hand-built sources as ``train_sources`` checks megatron's tensors."""
    t = plan.train
    if not 0 <= rank < t.world:
        return f"rank {rank} is outside the plan's {t.world} ranks"
    for spec in plan.specs:
        iv = t.interval(spec, rank)
        if iv is None or iv[1] <= iv[0] or spec.tied_copy and spec.key in sources:
            continue
        if spec.key not in sources:
            return f"sources lack {spec.key!r} (rows {iv[0]}..{iv[1]} of it are on this rank)"
        view, lo = sources[spec.key]
        want = spec.piece_shape(iv[1] - iv[0])
        if tuple(view.shape) != want or lo != iv[0]:
            return (f"source {spec.key!r} is rows {lo}.. of shape {tuple(view.shape)} but the "
                    f"plan needs rows {iv[0]}..{iv[1]} in its canonical shape {want}")
    return None


def _local_error(plan: Plan, sources: Mapping, assembler: Assembler, rank: int | None = None,
                 group=None, rank_error: str | None = None) -> tuple[str | None, torch.dtype]:
    """(this rank's first wrong input or None, the sources' dtype): what ``check_same_plan``
    reports on every rank (module doc)."""
    dtype = next((v.dtype for v, _ in sources.values()), torch.float32)
    rank = assembler.rank if rank is None else rank
    if rank_error:
        return rank_error, dtype
    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size(group)
        if size != plan.train.world:
            return (f"the plan is for {plan.train.world} ranks but the process group has "
                    f"{size}"), dtype
    if getattr(sources, "error", None):
        return sources.error, dtype
    if assembler.rank != rank:
        return (f"the assembler was built for rank {assembler.rank} but this process runs "
                f"rank {rank}"), dtype
    if error := _sources_error(plan, rank, sources):
        return error, dtype
    other = next((v.dtype for v, _ in sources.values() if v.dtype != dtype), None)
    if other is not None:
        return f"the training tensors mix {dtype} and {other}", dtype
    if torch.empty((), dtype=dtype).element_size() != plan.itemsize:
        return f"plan itemsize={plan.itemsize} but the training tensors are {dtype}", dtype
    if assembler.dtype != dtype:
        return f"assembler dtype={assembler.dtype} but the training tensors are {dtype}", dtype
    if assembler.into_error:
        return assembler.into_error, dtype
    return None, dtype


def _accept_local(plan: Plan, rank: int, sources: dict, assembler: Assembler, pieces) -> None:
    for key, lo, hi in pieces:
        assembler.accept(key, lo, hi, _piece(plan, sources, Transfer(key, rank, rank, lo, hi, 0)))


@dataclasses.dataclass
class Replay:
    """A recorded in-place run: its messages (flat views, peers, tags) and local row copies.

    ``run(group)`` posts every message at once in the recorded order (same tags, so a peer
    running ``run_plan`` matches it), copies the local rows while they travel and waits. Valid
    only while every tensor it holds views is still the memory the caller reads and writes
    (``hybridrl.rollout.engine_sync`` checks the addresses before each replay)."""

    ops: list[tuple[bool, torch.Tensor, int, int]]  # (is send, flat tensor, peer, tag)
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (destination rows, source rows)
    stats: RunStats

    def run(self, group=None) -> RunStats:
        ops = [dist.P2POp(dist.isend if send else dist.irecv, x, peer, group, tag)
               for send, x, peer, tag in self.ops]
        works = dist.batch_isend_irecv(ops) if ops else []
        for dst, src in self.copies:
            dst.copy_(src)
        for w in works:
            w.wait()
        return self.stats


@overload
def run_plan(plan: Plan, sources: Mapping, assembler: Assembler,
             group: ProcessGroup | None = None, *, rank: int | None = None, verify: bool = True,
             merges: Merges | None = None, recorder: list | None = None) -> RunStats: ...
@overload
def run_plan(plan: Plan, rank: int | None, sources: Mapping, assembler: Assembler,
             group: ProcessGroup | None = None, verify: bool = True,
             merges: Merges | None = None, recorder: list | None = None) -> RunStats: ...
def run_plan(plan: Plan, *args: Any, rank: int | None = None,  # noqa: E302
             group: ProcessGroup | None = None, verify: bool = True,
             merges: Merges | None = None, recorder: list | None = None) -> RunStats:
    """Execute this rank's part of ``plan`` (see module doc); collective over ``group``.

    ``run_plan(plan, sources, assembler)`` or ``run_plan(plan, rank, sources, assembler)``;
    ``rank`` defaults to this process's rank in ``group``. ``verify``: the agreement that makes
    a wrong input on any rank raise the same ValueError on every rank (module doc).
    ``merges``: agreed merged messages (``hybridrl.reshard.coalesce``). ``recorder``: a list
    that gets a ``Replay`` of this run when it received in place with no temporary buffer."""
    if args and isinstance(args[0], Mapping):  # (sources, assembler[, group])
        sources, assembler, *rest = args
    elif len(args) >= 3:  # (rank, sources, assembler[, group])
        rank, sources, assembler, *rest = args
    else:
        raise TypeError("run_plan(plan, sources, assembler) or "
                        "run_plan(plan, rank, sources, assembler)")
    if rest:
        if len(rest) > 1 or group is not None:
            raise TypeError("run_plan: too many positional arguments")
        group = rest[0]
    rank, rank_error = group_rank(rank, group)
    error, _ = _local_error(plan, sources, assembler, rank, group, rank_error)
    if verify:
        check_same_plan(plan, group, error, None if merges is None else "run")
    elif error:
        raise ValueError(error)
    sched = phase_schedule(plan, rank)
    mine = [(*plan.rank_buckets(rank)[k], k) for k in sched.buckets]
    sent = recv = peak_comm = peak_live = peak_asm = messages = 0
    posted: dict[int, _Bucket] = {}
    in_place = assembler.into is not None
    ops, replayable = [], recorder is not None and in_place
    if replayable:
        assembler.copies = []

    nxt, ready = 0, None

    def post_ahead(i):
        """Post up to bucket i and, receiving in place, every following bucket that needs no
        temporary buffer (its pieces go and land where they live: nothing held in flight)."""
        nonlocal nxt, ready
        while nxt < len(mine) and (nxt <= i or in_place):  # (preparing opens no buffer then)
            if ready is None:
                s, r, k = mine[nxt]
                ready = _Bucket(plan, sources, s, r, k, group, assembler, merges)
            if not (nxt <= i or (in_place and ready.temp_bytes == 0)):
                return
            posted[nxt], ready = ready.post(), None
            nxt += 1

    post_ahead(0)
    for pieces in sched.local:  # local phases -L..-1 overlap the first buckets' transfers
        _accept_local(plan, rank, sources, assembler, pieces)
        peak_asm = max(peak_asm, assembler.live_bytes)
        peak_live = max(peak_live, sum(b.temp_bytes for b in posted.values()) + assembler.live_bytes)
        assembler.flush()
    for i in range(len(mine)):
        post_ahead(i + 1)  # next bucket(s) in flight ...
        comm = sum(b.temp_bytes for b in posted.values())
        cur = posted.pop(i)
        replayable = replayable and cur.temp_bytes == 0
        if replayable:  # (recording only)
            ops += [(send, x, peer, cur.tag) for send, x, peer in cur.posted]
        cur.wait_and_deliver(plan, assembler)  # ... while this one is consumed
        _accept_local(plan, rank, sources, assembler, sched.at_bucket.get(mine[i][2], ()))
        peak_comm = max(peak_comm, comm)
        peak_asm = max(peak_asm, assembler.live_bytes)
        peak_live = max(peak_live, comm + assembler.live_bytes)
        sent, recv, messages = sent + cur.sent_bytes, recv + cur.recv_bytes, messages + cur.messages
        assembler.flush()
    peak_asm = max(peak_asm, assembler.live_bytes)
    peak_live = max(peak_live, assembler.live_bytes)
    stats = RunStats(sent, recv, len(mine), peak_live, peak_comm, peak_asm, messages)
    if replayable:
        recorder.append(Replay(ops, assembler.copies, stats))
    assembler.copies = None
    return stats


def run_plan_local(plan: Plan, sources: list[dict], assemblers: list[Assembler]) -> list[int]:
    """Single-process reference execution of every rank's part (tests, docs): the same phases,
    buckets and local pieces as ``run_plan``, copies instead of messages. Returns each rank's
    peak ``assembler.live_bytes`` (measured before every flush; no comm buffers here)."""
    errors = [err for r, (src, asm) in enumerate(zip(sources, assemblers))
              for err in (getattr(src, "error", None) and f"rank {r}: {src.error}",
                          asm.into_error) if err]
    if errors:  # what run_plan's agreement would report (train_sources' problems first)
        raise ValueError(errors[0])
    scheds = [phase_schedule(plan, r) for r in range(len(assemblers))]
    takes_part = [set(sched.buckets) for sched in scheds]
    peaks = [0] * len(assemblers)

    def flush(rank, pieces):
        _accept_local(plan, rank, sources[rank], assemblers[rank], pieces)
        peaks[rank] = max(peaks[rank], assemblers[rank].live_bytes)
        assemblers[rank].flush()

    for j in range(local_phases(plan)):
        for rank, sched in enumerate(scheds):
            flush(rank, sched.local[j])
    for k, bucket in enumerate(plan.buckets):
        for t in bucket:
            assemblers[t.dst].accept(t.key, t.lo, t.hi, _piece(plan, sources[t.src], t).clone())
        for rank, sched in enumerate(scheds):
            if k in takes_part[rank]:  # one flush per phase the rank takes part in
                flush(rank, sched.at_bucket.get(k, ()))
    return peaks
