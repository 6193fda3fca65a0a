"""Where each rank is: phase records in the job's key-value store, read when a collective fails.

Contract:
- ``PhaseBoard(store, rank, world)``: ``store`` is a ``torch.distributed.Store`` every rank
  reaches (the default group's, ``PhaseBoard.from_default_group()``; None when there is none);
  keys live under the ``hybridrl/phase/`` prefix.
- ``step_timing(step)`` returns a ``StepTiming``: the trainer's per-step timing dict whose
  ``enter(key)`` records "rank r is in phase ``key`` (a ``timing_s/...`` name) of step ``step``"
  (one store write per phase, no collective).
- ``where(rank)`` -> (step, phase) or None (never recorded); ``stragglers(rank)``: the other
  ranks whose record differs from ``rank``'s (they did not reach the collective it waits in),
  with their records.
- ``start_heartbeat(interval_s)``: a daemon thread writes this rank's wall time to the store
  every ``interval_s`` (one small write; it stops quietly when the store is gone, and
  ``stop_heartbeat()`` ends it before the process exits);
  ``silent(stale_s)``: the other ranks whose last heartbeat is older than ``stale_s`` (stopped
  by SIGSTOP, hung in C, killed, exited) with its age.
- ``describe_timeout(rank, timeout_s)`` and ``describe_peer_loss(rank, err)``: one line that
  names the late or gone ranks (silent ones first, else those in another phase) and their
  last phase; a "timeout" with no silent and no late rank waits for heartbeats to age and,
  when one went silent meanwhile, is that rank's loss (gloo words a peer's death so). The line does not depend on which rank writes it, so the failure reporter
  (``hybridrl.exits``) shows it once.
- ``is_timeout(err)``: whether an exception is a collective's timeout: a RuntimeError raised by
  torch / gloo / NCCL (not by hybridrl or user code: a reward function's ``TimeoutError`` or
  ``ConnectionError("read timed out")`` is not one) whose message says "timed out" / "Timeout".
"""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

PREFIX = "hybridrl/phase/"
READ_TIMEOUT_S = 5.0
HEARTBEAT_S, STALE_S = 0.5, 2.0  # heartbeat period; older than STALE_S: the rank is silent


class StepTiming(dict):
    """The timing dict of one step that also records the current phase on a board."""

    def __init__(self, board: PhaseBoard, step: int) -> None:
        super().__init__()
        self.board, self.step = board, step

    def enter(self, key: str) -> None:
        self.board.record(self.step, key)


class PhaseBoard:
    """Per-rank (step, phase) records in a shared store (see module docstring)."""

    def __init__(self, store, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.beating = None  # (thread, stop event) of start_heartbeat

    @classmethod
    def from_default_group(cls) -> PhaseBoard:
        store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        return cls(store, dist.get_rank() if store else 0, dist.get_world_size() if store else 1)

    def record(self, step: int, phase: str) -> None:
        if self.store is not None:
            self.store.set(f"{PREFIX}{self.rank}", f"{step} {phase}")

    def step_timing(self, step: int) -> StepTiming:
        return StepTiming(self, step)

    def where(self, rank: int) -> tuple[int, str] | None:
        key = f"{PREFIX}{rank}"
        if self.store is None:
            return None
        try:
            self.store.set_timeout(datetime.timedelta(seconds=READ_TIMEOUT_S))
            if not self.store.check([key]):
                return None
            step, phase = self.store.get(key).decode().split(" ", 1)
            return int(step), phase
        except Exception:  # the store's host is gone: nothing to report
            return None

    def stragglers(self, rank: int) -> dict[int, tuple[int, str] | None]:
        mine = self.where(rank)
        return {r: w for r in range(self.world) if r != rank and (w := self.where(r)) != mine}

    def start_heartbeat(self, interval_s: float = HEARTBEAT_S) -> None:
        if self.store is None or self.world == 1 or self.beating is not None:
            return
        key, store, stop = f"{PREFIX}beat/{self.rank}", self.store, threading.Event()

        def beat():
            while not stop.is_set():
                try:
                    store.set(key, repr(time.time()))
                except Exception:  # the store's host is gone: the job is ending
                    return
                stop.wait(interval_s)

        self.beating = (threading.Thread(target=beat, name="hybridrl-heartbeat", daemon=True),
                        stop)
        self.beating[0].start()

    def stop_heartbeat(self) -> None:
        """End the heartbeat thread (before the process exits: no store call at teardown)."""
        if self.beating is not None:
            thread, stop = self.beating
            stop.set()
            thread.join(timeout=READ_TIMEOUT_S)
            self.beating = None

    def silent(self, stale_s: float) -> dict[int, float]:
        """Other ranks whose heartbeat is older than ``stale_s`` -> its age in seconds."""
        if self.store is None:
            return {}
        out, now = {}, time.time()
        try:
            self.store.set_timeout(datetime.timedelta(seconds=READ_TIMEOUT_S))
            for r in range(self.world):
                key = f"{PREFIX}beat/{r}"
                if r != self.rank and self.store.check([key]):
                    age = now - float(self.store.get(key).decode())
                    if age > stale_s:
                        out[r] = age
        except Exception:  # the store's host is gone: nothing to report
            return {}
        return out

    def _named(self, ranks, how) -> str:
        parts = []
        for r in sorted(ranks):
            w = self.where(r)
            parts.append(f"rank {r} {how(r)}, last in "
                         + (f"{w[1]} of step {w[0]}" if w else "no recorded phase"))
        return "; ".join(parts)

    def describe_timeout(self, rank: int, timeout_s: float) -> str:
        mine = self.where(rank)
        at = f"in {mine[1]} of step {mine[0]}" if mine else "before the first step"
        gone = self.silent(min(STALE_S * 2, timeout_s / 2))
        late = self.stragglers(rank)
        if not gone and not late:  # gloo words a peer's death "timed out" when the socket
            lost = self.describe_peer_loss(rank, None)  # closes mid-wait: a rank that just
            if lost:  # died has a fresh heartbeat, so let it age and look again
                return lost
        if gone:
            who = self._named(gone, lambda r: f"stopped responding (no heartbeat for "
                                              f"{gone[r]:.0f} s: stopped, hung or dead)")
        elif not late:
            who = "no rank recorded another phase (a rank may have died)"
        else:
            who = "ranks " + str(sorted(late)) + " did not arrive (" + "; ".join(
                f"rank {r}: " + (f"{w[1]} of step {w[0]}" if w else "no phase recorded")
                for r, w in sorted(late.items())) + ")"
        return (f"a collective timed out after {timeout_s:g} s "
                f"(trainer.collective_timeout_s) {at}: {who}")

    def describe_peer_loss(self, rank: int, err: BaseException) -> str | None:
        """One line naming the rank(s) whose process is gone, or None when none is found."""
        time.sleep(STALE_S + HEARTBEAT_S)  # a rank that just died: let its heartbeat age
        gone = self.silent(STALE_S)
        if not gone:
            return None
        return ("a rank's process is gone (killed, crashed, or it exited: os._exit, a signal): "
                + self._named(gone, lambda r: f"has sent no heartbeat for {gone[r]:.0f} s")
                + "; the other ranks stop")


def is_timeout(err: BaseException) -> bool:
    if not isinstance(err, RuntimeError) or type(err).__module__.startswith("hybridrl"):
        return False  # hybridrl's own errors (a reward timeout) name themselves
    if isinstance(err.__cause__ or err.__context__, (TimeoutError, ConnectionError)):
        return False  # raised while handling a user-level timeout, not by a collective
    text = str(err).lower()
    return "timed out" in text or "timeout" in text
