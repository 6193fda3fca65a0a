"""Step metrics of the PPO loop: one console line per step and ``metrics.jsonl``, rank 0 only.

Contract:
- ``MetricsLog(rank, folder, loggers, print_fn)``: every method is a no-op on ranks other than 0.
- ``line(text)`` prints ``text`` (flushed).
- ``step(step, total, metrics)`` prints ``step <step>/<total> | score .. | pg_loss .. | ...`` (the
  keys of ``SUMMARY`` that ``metrics`` has; ``| rolled back: not kept`` when the step guard
  undid it, ``training/rolled_back``) and, when ``"jsonl"`` is in ``loggers``, appends
  ``{"step": step, "kept": bool, **metrics}`` as one line to ``<folder>/metrics.jsonl``.
- ``resume_at(step)`` rewrites ``metrics.jsonl`` to hold exactly the lines of steps <= ``step``
  (none for a fresh run, step 0), so a resumed run appends without duplicates.
"""

from __future__ import annotations

import json
from pathlib import Path

# (short name on the console, metric key)
SUMMARY = (("score", "critic/score/mean"), ("pg_loss", "actor/pg_loss"),
           ("ppo_kl", "actor/ppo_kl"), ("kl_loss", "actor/kl_loss"),
           ("vf_loss", "critic/vf_loss"), ("entropy", "actor/entropy"),
           ("len", "response_length/mean"), ("val", "val/score/mean"),
           ("gen_s", "timing_s/gen"), ("reshard_s", "timing_s/reshard"),
           ("step_s", "timing_s/step"))


class MetricsLog:
    """Console and jsonl sink of the trainer (see module docstring)."""

    def __init__(self, rank: int, folder: str | Path, loggers, print_fn=print):
        self.active, self.print = rank == 0, print_fn
        self.path = Path(folder) / "metrics.jsonl"
        self.jsonl = "jsonl" in loggers

    def line(self, text: str) -> None:
        if self.active:
            self.print(text, flush=True)

    def step(self, step: int, total: int, metrics: dict) -> None:
        if not self.active:
            return
        parts = [f"{short} {metrics[k]:.4g}" for short, k in SUMMARY if k in metrics]
        kept = not metrics.get("training/rolled_back")
        self.print(f"step {step}/{total} | " + " | ".join(parts)
                   + ("" if kept else " | rolled back: not kept"), flush=True)
        if self.jsonl:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "kept": kept, **metrics}) + "\n")

    def resume_at(self, step: int) -> None:
        if not (self.active and self.jsonl):
            return
        kept = [] if step == 0 or not self.path.exists() else [
            line for line in self.path.read_text().splitlines()
            if line and json.loads(line).get("step", 0) <= step]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(line + "\n" for line in kept))
