"""The step guard: non-finite values and excessive policy KL never reach the kept weights.

Contract:
- ``StepGuard(trainer_cfg, device, log)``; ``needs_snapshot`` says whether the trainer must copy
  its state (each rank's optimizer shard) to host memory before each step: KL guard on, or
  ``trainer.nonfinite=rollback``. With the default ``skip`` no copy is made: the optimizer itself
  refuses any update whose gradient norm is not finite (``ModelOptimizer.step``), so non-finite
  values never reach the weights; the step is counted and its finite updates are kept (rolled
  back instead when a KL-guard snapshot exists).
- ``check_inputs(step, scores, tensors, rb)`` (collective: every rank, once per step) looks for
  non-finite rewards, advantages and returns; every rank agrees through one all-reduce. Non-finite
  reward rows are named with their batch row, data_source and ``extra_info['index']``; on a
  non-finite step one gather gives every rank the same line: the lowest rank's own, with its
  rank (and the other ranks that found one). Returns the problem (one line) or None; the trainer then skips the updates. With ``nonfinite=fail`` it raises
  ``RuntimeError`` instead.
- ``judge(step, metrics, input_problem, snapshot, restore, models)`` (collective) decides the
  step once for all ranks with one all-reduce of [non-finite, KL]: non-finite metrics of the
  updates (loss, grad norm, KL, entropy, ...) or parameters on any rank, or a KL (the largest
  |actor/ppo_kl| and |actor/ppo_kl_final|, a NaN counts as non-finite, never as "small") above
  ``trainer.kl_guard.max_kl``. A rejected step is rolled back when there is a snapshot
  (``restore(snapshot)``: weights, optimizers and KL controller as before the step, the batch
  skipped), kept minus its refused updates when there is none (``skip``), or raises
  ``RuntimeError`` (``nonfinite=fail``, ``kl_guard.rollback=false``, more than
  ``kl_guard.max_rollbacks`` consecutive rollbacks, more than ``trainer.nonfinite_max_steps``
  consecutive non-finite steps with ``skip`` (``nonfinite=skip`` has no rollback limit for
  non-finite steps), or non-finite weights with no snapshot). Returns the metrics
  ``training/nonfinite_steps`` (running count), ``training/rolled_back`` (1 when the step's
  updates were not kept) and, with the KL guard on, ``training/kl_guard_rollback``.
  With ``kl_guard.mode=checkpoint`` a KL over ``max_kl`` takes no per-step snapshot: ``judge``
  sets ``restore_checkpoint`` (the problem line) and the trainer's checkpointer restores the
  latest checkpoint with a lower lr (``hybridrl.checkpoint.checkpointer``); the
  ``kl_guard.max_rollbacks``-th + 1 such rollback of the run raises ``RuntimeError`` naming
  the step, the KL and the limit.
- ``final_kl(rb, old, mask, logprobs, dp_group)`` (collective over the replica's ranks and DP):
  ``actor/ppo_kl_final``, the policy KL of the weights the step would keep, from one forward
  (``logprobs(sub_batch)``) over ``kl_rows(n, kl_guard.row_fraction)`` of this rank's rows
  (every k-th row, k = round(1 / fraction); 1.0 = every row), token-weighted over every DP
  rank's sampled rows; also ``actor/ppo_kl_final_rows`` (rows read, all DP ranks).
- ``state_dict()`` / ``load_state_dict()``: the counters, saved with checkpoints.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# metrics whose non-finite value means the step trained on garbage
WATCHED_PREFIXES = ("actor/", "critic/", "reward/")


def nan_max(values) -> float:
    """max() that returns NaN when any value is NaN (Python's max() may silently drop it)."""
    values = [float(v) for v in values]
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values) if values else 0.0


def nonfinite_keys(metrics: dict) -> list[str]:
    """The watched metric keys whose value is NaN or infinite."""
    return sorted(k for k, v in metrics.items() if k.startswith(WATCHED_PREFIXES)
                  and isinstance(v, (int, float)) and not math.isfinite(v))


def nonfinite_rows(scores: torch.Tensor) -> list[int]:
    """Indices of the rows of ``scores`` [N] that are NaN or infinite."""
    return torch.nonzero(~torch.isfinite(scores.float())).flatten().tolist()


def describe_rows(rows: list[int], rb, limit: int = 5) -> str:
    """``row i (data_source 'x', index k)`` for the first ``limit`` rows of a rollout batch."""
    parts = []
    for i in rows[:limit]:
        extra = rb.extra_info[i] if rb.extra_info[i] is not None else {}
        row = rb.rows[i] if getattr(rb, "rows", None) is not None else i  # the batch's row
        parts.append(f"row {row} (data_source {rb.data_source[i]!r}, index {extra.get('index')})")
    more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
    return ", ".join(parts) + more


def params_finite(models) -> bool:
    """True when every device-resident parameter of this rank's trainable models is finite
    (parameters offloaded to host memory by hybridrl.trainer.phase_memory are skipped: their storage is
    empty until their next phase)."""
    return all(bool(torch.isfinite(p).all()) for m, _ in models for p in m.module.parameters()
               if p.untyped_storage().nbytes())


def kl_rows(n: int, fraction: float) -> list[int]:
    """The rows the final-KL forward reads: every k-th of ``n`` (k = round(1 / fraction)), so a
    prompt group of consecutive samples is read at its first sample at k >= its size."""
    return list(range(0, n, max(1, round(1.0 / fraction))))


class StepGuard:
    """Decides, identically on every rank, whether a step is kept (see module docstring)."""

    def __init__(self, trainer_cfg, device, log) -> None:
        self.mode, self.kl = trainer_cfg.nonfinite, trainer_cfg.kl_guard
        self.device, self.log = device, log
        self.consecutive, self.nonfinite_steps = 0, 0
        self.max_skips = getattr(trainer_cfg, "nonfinite_max_steps", 0)
        self.nonfinite_run = 0  # consecutive non-finite steps (nonfinite_max_steps)
        self.checkpoint_rollbacks, self.restore_checkpoint = 0, None

    @property
    def needs_snapshot(self) -> bool:
        """A per-step host copy of the optimizer shards: only for the KL guard and
        ``nonfinite=rollback`` (``skip`` relies on the optimizer refusing non-finite updates)."""
        return (self.kl.max_kl > 0 and self.kl.mode == "step") or self.mode == "rollback"

    def _agree_max(self, values: list[float]) -> list[float]:
        """Element-wise max over every rank (NCCL takes no CPU tensors: on the model device)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def check_inputs(self, step: int, scores: torch.Tensor, tensors: dict, rb) -> str | None:
        rows = nonfinite_rows(scores)
        bad = [k for k in ("advantages", "returns") if k in tensors
               and not bool(torch.isfinite(tensors[k]).all())]
        (flag,) = self._agree_max([1.0 if rows or bad else 0.0])
        if not flag:
            return None
        problem = None
        if rows:
            problem = (f"step {step}: the reward is not finite for {len(rows)} of {len(scores)} "
                       f"rows: {describe_rows(rows, rb)}")
        elif bad:
            problem = f"step {step}: non-finite {' and '.join(bad)}"
        problem = self._first_problem(problem)
        if self.mode == "fail":
            raise RuntimeError(f"{problem} (trainer.nonfinite=fail)")
        return problem

    def _first_problem(self, mine: str | None) -> str:
        """The same line on every rank: the lowest rank's own (its rows named), and which other
        ranks found one too (one small gather, only on a non-finite step)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return mine or "non-finite rewards or advantages"
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)
        ranks = [r for r, p in enumerate(seen) if p]
        if not ranks:
            return "non-finite rewards or advantages"
        others = f" (rank {ranks[0]}" + (f"; also ranks {ranks[1:]})" if ranks[1:] else ")")
        return seen[ranks[0]] + (others if ranks != [0] else "")

    def final_kl(self, rb, old: torch.Tensor, mask: torch.Tensor, logprobs, dp_group) -> dict:
        """``actor/ppo_kl_final`` over a sample of the rows (see the module docstring)."""
        rows = kl_rows(len(rb), self.kl.row_fraction)
        sub = rb if len(rows) == len(rb) else rb.subset(rows)
        new = logprobs(sub)
        m = mask[rows].float()
        kl = torch.stack([((old[rows] - new) * m).sum().double(), m.sum().double(),
                          torch.tensor(float(len(rows)), dtype=torch.float64)])
        if dp_group is not None:  # over every DP rank's sampled rows
            dist.all_reduce(kl, group=dp_group)
        return {"actor/ppo_kl_final": float(kl[0] / kl[1].clamp(min=1)),
                "actor/ppo_kl_final_rows": float(kl[2])}

    def judge(self, step: int, metrics: dict, input_problem: str | None, snapshot, restore,
              models) -> dict:
        keys = nonfinite_keys(metrics)
        finite_params = params_finite(models)
        kl = nan_max([metrics.get("actor/ppo_kl_max", 0.0),
                      abs(metrics.get("actor/ppo_kl_final", 0.0))]) if self.kl.max_kl > 0 else 0.0
        local_bad = bool(keys) or not finite_params or not math.isfinite(kl)
        flag, worst = self._agree_max([1.0 if local_bad else 0.0, kl if math.isfinite(kl) else 0.0])
        out = {}
        if self.kl.max_kl > 0:
            out["training/kl_guard_rollback"] = 0.0
        problem, is_kl = input_problem, False
        if problem is None and flag:
            what = ", ".join(keys) if keys else ("parameters" if not finite_params else "")
            problem = (f"step {step}: non-finite {what or 'values on another rank'}"
                       + ("" if math.isfinite(kl) else " (policy KL is NaN)"))
        if problem is None and worst > self.kl.max_kl > 0:
            problem, is_kl = f"step {step}: policy KL {worst:.4g} > max_kl {self.kl.max_kl}", True
        if problem is None:
            self.consecutive = self.nonfinite_run = 0
            return {**out, "training/nonfinite_steps": float(self.nonfinite_steps),
                    "training/rolled_back": 0.0}
        if is_kl and self.kl.mode == "checkpoint" and self.kl.rollback:
            self.checkpoint_rollbacks += 1
            if self.checkpoint_rollbacks > self.kl.max_rollbacks:
                raise RuntimeError(f"{problem}: trainer.kl_guard.max_rollbacks="
                                   f"{self.kl.max_rollbacks} checkpoint rollbacks already done, "
                                   "stopping")
            self.restore_checkpoint = problem
            return {**out, "training/kl_guard_rollback": 1.0,
                    "training/nonfinite_steps": float(self.nonfinite_steps),
                    "training/rolled_back": 1.0}
        self._refuse_or_count(problem, is_kl)
        if snapshot is None:  # skip: the optimizer refused every non-finite update
            if not finite_params:
                raise RuntimeError(f"{problem}: the weights are not finite and there is no "
                                   "snapshot to restore (trainer.nonfinite=rollback keeps one)")
            kept = input_problem is None  # bad inputs: no update ran at all
            self.log.line(f"{problem}: " + ("non-finite updates skipped by the optimizer, the "
                                            "others kept" if kept else "updates skipped"))
            return {**out, "training/nonfinite_steps": float(self.nonfinite_steps),
                    "training/rolled_back": 0.0 if kept else 1.0}
        restore(snapshot)
        self.log.line(f"{problem}: rolled back (rollback {self.consecutive}"
                      + (f"/{self.kl.max_rollbacks})" if self._limited(is_kl) else ")"))
        if is_kl:
            out["training/kl_guard_rollback"] = 1.0
        return {**out, "training/nonfinite_steps": float(self.nonfinite_steps),
                "training/rolled_back": 1.0}

    def _limited(self, is_kl: bool) -> bool:
        return is_kl or self.mode == "rollback"

    def _refuse_or_count(self, problem: str, is_kl: bool) -> None:
        if is_kl and not self.kl.rollback:
            raise RuntimeError(f"{problem} (trainer.kl_guard.rollback=false: rollback disabled)")
        if not is_kl:
            self.nonfinite_steps += 1
            self.nonfinite_run += 1
            if self.mode == "fail":
                raise RuntimeError(f"{problem} (trainer.nonfinite=fail)")
            if self.mode == "skip" and 0 < self.max_skips < self.nonfinite_run:
                raise RuntimeError(f"{problem}; {self.nonfinite_run} consecutive non-finite "
                                   f"steps (trainer.nonfinite_max_steps={self.max_skips}): "
                                   "giving up (lower actor.lr, check the reward function)")
        self.consecutive += 1
        if self._limited(is_kl) and self.consecutive > self.kl.max_rollbacks:
            raise RuntimeError(f"{problem}; {self.consecutive} consecutive rollbacks: giving up "
                               "(lower actor.lr, or raise trainer.kl_guard.max_kl / max_rollbacks)")

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "nonfinite_steps": self.nonfinite_steps,
                "nonfinite_run": self.nonfinite_run,
                "checkpoint_rollbacks": self.checkpoint_rollbacks}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self.nonfinite_run = int(state.get("nonfinite_run", 0))
        self.checkpoint_rollbacks = int(state.get("checkpoint_rollbacks", 0))
