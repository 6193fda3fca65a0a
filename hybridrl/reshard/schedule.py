"""When each rank consumes its local copies: the phases of a reshard (pure, no process group).

Contract:
- ``phase_schedule(plan, rank) -> PhaseSchedule`` is a pure function of the plan (cached on
  it), so every rank can derive every other rank's schedule without communication. The executor
  (``run_plan``, ``run_plan_local``) and the SGLang push (``WeightPusher.start``) both read it.
- Phases: ``-L .. -1`` (local phases), then the buckets ``0 .. B-1``. ``L = local_phases(plan)``
  is the same on every rank: the most local-only chunks (below) of any rank of the plan's world,
  and at least 1. Each phase a rank takes part in ends with one Assembler flush: every local
  phase on every rank (empty ones included), then each bucket the rank sends or receives in.
- A local piece (rows a rank copies from its own training tensors, ``plan.locals[rank]``) of a
  key of which the rank also receives rows is accepted in the phase of the LAST bucket that
  delivers a row of that key to the rank, after that bucket's receives: no buffer is opened for
  it before its first receiving bucket is posted, and it completes in that phase.
- Keys completed by local pieces alone are packed, in plan order, into chunks of at most
  ``plan.bucket_bytes`` (canonical bytes; a key larger than that is a chunk of its own); chunk j
  is accepted in phase -L + j. So no flush emits more than one bucket of local-only rows, or one
  larger key. Every local piece is scheduled exactly once.
- ``PhaseSchedule``: ``local`` (L tuples of pieces ``(key, lo, hi)``, empty after this rank's
  chunks), ``at_bucket`` (bucket index -> pieces accepted after its receives), ``buckets`` (the
  buckets this rank sends or receives in, ascending) and ``phases`` (``-L..-1``, then ``buckets``).
"""

from __future__ import annotations

import dataclasses

from hybridrl.reshard.planner import Plan

Piece = tuple[str, int, int]  # (key, lo, hi): canonical rows [lo, hi) of a parameter


@dataclasses.dataclass(frozen=True)
class PhaseSchedule:
    """One rank's phases of a reshard (module doc): ``local`` pieces per local phase,
    ``at_bucket`` pieces accepted after a bucket's receives, ``buckets`` it takes part in."""

    local: tuple[tuple[Piece, ...], ...]
    at_bucket: dict[int, tuple[Piece, ...]]
    buckets: tuple[int, ...]

    @property
    def phases(self) -> tuple[int, ...]:
        """Every phase this rank flushes in: -L..-1, then its buckets."""
        return tuple(range(-len(self.local), 0)) + self.buckets


def _last_receipt(plan: Plan) -> dict[tuple[int, str], int]:
    """(dst, key) -> the last bucket delivering a row of ``key`` to ``dst`` (cached)."""
    if "last_receipt" not in plan._cache:
        last = {}
        for k, bucket in enumerate(plan.buckets):
            for t in bucket:
                last[(t.dst, t.key)] = k
        plan._cache["last_receipt"] = last
    return plan._cache["last_receipt"]


def local_chunks(plan: Plan, rank: int) -> tuple[tuple[Piece, ...], ...]:
    """This rank's keys completed by local pieces alone, packed in plan order into chunks of at
    most ``plan.bucket_bytes`` (a larger key alone); all pieces of one key in one chunk."""
    if ("local_chunks", rank) in plan._cache:
        return plan._cache[("local_chunks", rank)]
    last = _last_receipt(plan)
    by_key: dict[str, list[Piece]] = {}
    for piece in plan.locals[rank]:
        if (rank, piece[0]) not in last:
            by_key.setdefault(piece[0], []).append(piece)
    chunks, cur, size = [], [], 0
    for key, pieces in by_key.items():
        nbytes = sum(hi - lo for _, lo, hi in pieces) * plan.spec(key).row_numel * plan.itemsize
        if cur and size + nbytes > plan.bucket_bytes:
            chunks.append(tuple(cur))
            cur, size = [], 0
        cur += pieces
        size += nbytes
    if cur:
        chunks.append(tuple(cur))
    plan._cache[("local_chunks", rank)] = tuple(chunks)
    return plan._cache[("local_chunks", rank)]


def local_phases(plan: Plan) -> int:
    """L: the most local-only chunks of any rank of the plan's world, at least 1 (cached)."""
    if "local_phases" not in plan._cache:
        plan._cache["local_phases"] = max(
            [1] + [len(local_chunks(plan, r)) for r in range(len(plan.locals))])
    return plan._cache["local_phases"]


def phase_schedule(plan: Plan, rank: int) -> PhaseSchedule:
    """This rank's phases and the local pieces each one accepts (see module doc; cached)."""
    if ("phase_schedule", rank) in plan._cache:
        return plan._cache[("phase_schedule", rank)]
    last = _last_receipt(plan)
    chunks = local_chunks(plan, rank)
    n = local_phases(plan)
    at_bucket: dict[int, list[Piece]] = {}
    for piece in plan.locals[rank]:
        k = last.get((rank, piece[0]))
        if k is not None:
            at_bucket.setdefault(k, []).append(piece)
    buckets = tuple(k for k, (s, r) in enumerate(plan.rank_buckets(rank)) if s or r)
    out = PhaseSchedule(chunks + ((),) * (n - len(chunks)),
                        {k: tuple(v) for k, v in at_bucket.items()}, buckets)
    plan._cache[("phase_schedule", rank)] = out
    return out
