"""Bucket-by-bucket weight push of one gen-TP group's engine-format shards into one engine.

Contract (no SGLang needed; tested on gloo with a fake engine):
- ``WeightPusher(rank, members, group, table, dtype, serialize, load)``: ``members`` are the
  global ranks of one gen-TP group in gen-TP order (``members[0]`` owns the engine), ``group``
  a gloo group over them (None for one member). ``serialize(named) -> payload`` runs on every
  rank; ``load(payloads) -> (ok, message)`` runs on the source with one payload per gen-TP
  rank (SGLang: ``update_weights_from_tensor`` with per-rank payloads, load_format "direct").
- Rounds: ``start(plan)`` fixes this sync's schedule, one round per reshard phase
  (``hybridrl.reshard.schedule.phase_schedule``, the executor's own): the local phases -L..-1,
  then every bucket of ``plan.buckets``, the same L + B rounds on every rank of the group (L is
  a function of the plan alone). The Assembler calls ``sink`` at every flush
  (``sink_every_flush``): after each local phase and after each bucket this rank takes part in.
  A flush's tensors go into the round of its phase; the rounds of buckets in which this rank has
  no transfers run empty right after its previous flush (the rank has already posted its next
  bucket, so no peer waits on it). ``finish(close, settle)`` runs the remaining empty rounds,
  ``settle()`` on every rank (the adapter: empty the CUDA cache, then a barrier), then
  ``close()`` on the source (end the session, resume, flush).
- One round: each rank checks its tensors against ``table`` (name, per-rank shape, dtype),
  waits for its CUDA stream (received data is complete before IPC handles leave), serializes,
  and the source gathers (payload, problem, first name) over ``group``. Any problem: nothing is
  loaded and every rank raises ValueError naming it. Else the source calls ``load`` if any
  payload is non-empty and broadcasts (ok, message); the tensors stay referenced until that
  broadcast returns (the engine has copied them), then are dropped; a failed load raises
  RuntimeError on every rank naming the round's first tensor.
- Memory: a round holds only what one flush emitted and drops it before the next, so the
  whole shard is never buffered. Every round, the first included, holds at most about one
  bucket: a local phase at most ``plan.bucket_bytes`` of parameters the rank's own training
  piece completes (or one larger parameter), a bucket round what that bucket completes (the
  planner charges a parameter's local rows to its last receiving bucket), plus at most the rows
  of one parameter begun in an earlier bucket. ``round_bytes`` lists the bytes each round of the
  current sync held on this rank, ``peak_round_bytes`` the most over all syncs; ``rounds``
  counts rounds run (tests).
- Waits: every gather/broadcast runs on ``group``, whose timeout the caller sets (the adapter:
  ``rollout.timeout_s``); a wait that fails (timeout, peer gone) raises RuntimeError starting
  with ``wait_label`` (which names the engine) and the collective's own first line.
- ``src_error``: set on the source when an engine call outside a round failed (e.g. opening
  the session); the next round then fails on every rank with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from hybridrl.reshard.schedule import phase_schedule
from hybridrl.rollout.sglang.layout import check_named_tensors


def bounded(wait: Callable, label: str):
    """Run one collective ``wait()``; its failure (timeout, peer gone) becomes one line."""
    try:
        return wait()
    except Exception as err:  # gloo raises plain RuntimeError on timeouts and lost peers
        line = (str(err).splitlines() or [repr(err)])[0]
        raise RuntimeError(f"{label}: {type(err).__name__}: {line}") from None


class WeightPusher:
    """See the module docstring."""

    def __init__(self, rank: int, members: list[int], group, table: dict, dtype: torch.dtype,
                 serialize: Callable, load: Callable, wait_label: str = "SGLang engine"):
        self.rank, self.members, self.group = rank, list(members), group
        self.wait_label = wait_label
        self.src, self.is_src = members[0], rank == members[0]
        self.table, self.dtype, self.serialize, self.load = table, dtype, serialize, load
        self.src_error: str | None = None
        self.phases: list[int] = []
        self.round_bytes: list[int] = []
        self.n_buckets = self.calls = self.rounds = self.peak_round_bytes = self.next_phase = 0

    def start(self, plan) -> None:
        """This sync's schedule: the reshard's phases, local phases -L..-1 then this rank's
        buckets (``phase_schedule``, the executor's own)."""
        self.phases = list(phase_schedule(plan, self.rank).phases)
        self.n_buckets = len(plan.buckets)
        self.calls, self.next_phase, self.round_bytes = 0, self.phases[0], []

    def sink(self, named) -> None:
        """Assembler sink: one call per flush, ``named`` possibly empty (see module doc)."""
        named = list(named)
        c, self.calls = self.calls, self.calls + 1
        if c >= len(self.phases):  # Assembler.result()'s last flush: nothing new can be left
            assert not named, [n for n, _ in named]
            return
        phase = self.phases[c]
        until = self.phases[c + 1] if c + 1 < len(self.phases) else phase + 1
        assert self.next_phase == phase, (self.next_phase, phase)
        self._round(named)
        del named
        while self.next_phase < until:
            self._round([])

    def finish(self, close: Callable[[], tuple[bool, str]] | None = None,
               settle: Callable[[], None] | None = None) -> None:
        """Empty rounds up to the last bucket, ``settle()`` on every rank (the rounds are over
        everywhere), then ``close`` on the source."""
        if self.calls < len(self.phases):
            raise AssertionError(f"rank {self.rank}: {self.calls} flushes, "
                                 f"expected {len(self.phases)}")
        while self.next_phase < self.n_buckets:
            self._round([])
        if settle is not None:
            settle()
        result = (True, "")
        if self.is_src and close is not None:
            result = (False, self.src_error) if self.src_error else close()
        ok, message = self._share(result)
        if not ok:
            raise RuntimeError(f"SGLang engine of gen-TP group {self.members}: {message}")

    def _share(self, result):
        if self.group is None:
            return result
        box = [result]
        bounded(lambda: dist.broadcast_object_list(box, src=self.src, group=self.group),
                self.wait_label)
        return box[0]

    def _round(self, named: list) -> None:
        self.next_phase += 1
        self.rounds += 1
        problem = check_named_tensors(named, self.table, self.dtype)
        self.round_bytes.append(sum(t.numel() * t.element_size() for _, t in named))
        self.peak_round_bytes = max(self.peak_round_bytes, self.round_bytes[-1])
        payload = None
        if named and problem is None:
            for device in {t.device for _, t in named if t.is_cuda}:
                torch.cuda.current_stream(device).synchronize()  # received data is complete
            payload = self.serialize(named)
        mine = (payload, problem and f"rank {self.rank}: {problem}", named[0][0] if named else None)
        if self.group is None:
            parts = [mine]
        else:
            parts = [None] * len(self.members) if self.is_src else None
            bounded(lambda: dist.gather_object(mine, parts, dst=self.src, group=self.group),
                    self.wait_label)
        kind, message = self._share(self._decide(parts) if self.is_src else None)
        # only now may the producers go: the engine has copied this round's tensors
        if kind == "input":
            raise ValueError(message)
        if kind == "engine":
            raise RuntimeError(message)

    def _decide(self, parts) -> tuple[str | None, str]:
        """Source: (None | 'input' | 'engine', message) of one round."""
        problems = [p for _, p, _ in parts if p]
        if problems:
            return "input", f"{problems[0]}; nothing was sent to the engine"
        if self.src_error:
            return "engine", self.src_error
        if all(payload is None for payload, _, _ in parts):
            return None, ""
        empty = self.serialize([])
        ok, message = self.load([payload if payload is not None else empty
                                 for payload, _, _ in parts])
        if ok:
            return None, ""
        first = next(name for _, _, name in parts if name)
        return "engine", f"the engine rejected a weight update (first tensor {first!r}): {message}"
