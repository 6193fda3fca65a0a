"""Progress lines: start-up phases with their time, step lines with an ETA, sample generations.

Contract (every method is a no-op on ranks other than 0; lines are printed flushed):
- ``Progress(rank, folder, print_fn, prefix="")``; ``start(total)`` marks the first step's start.
- ``phase(name)`` prints ``hybridrl: <name> (<seconds since the previous phase> s)``: one line
  per start-up phase (models built, weights loaded, engine ready, first sync, ...).
- ``eta(step)`` is ``"<m>m<ss>s"``: the mean time per step so far times the steps left.
- ``step(step, metrics, keys)`` prints ``<prefix>step <step>/<total> | <short> <value> ... |
  eta <eta>`` (the ``(short, key)`` pairs of ``keys`` that ``metrics`` has) and appends
  ``{"step": step, **metrics}`` to ``<folder>/metrics.jsonl``.
- ``samples(step, samples, n_print=3)`` prints the first ``n_print`` samples (prompt tail,
  response, ground truth, score) and appends all of them, each with ``"step"``, to
  ``<folder>/generations.jsonl``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def format_eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """Rank 0's progress sink (see the module docstring)."""

    def __init__(self, rank: int, folder: str | Path, print_fn=print, prefix: str = ""):
        self.active, self.print, self.prefix = rank == 0, print_fn, prefix
        self.folder = Path(folder)
        self.last = self.t0 = time.perf_counter()
        self.total, self.first_step = 0, 0

    def start(self, total: int, first_step: int = 0) -> None:
        self.total, self.first_step, self.t0 = total, first_step, time.perf_counter()

    def phase(self, name: str) -> None:
        now = time.perf_counter()
        if self.active:
            self.print(f"hybridrl: {name} ({now - self.last:.1f} s)", flush=True)
        self.last = now

    def eta(self, step: int) -> str:
        done = step - self.first_step
        per_step = (time.perf_counter() - self.t0) / max(done, 1)
        return format_eta(per_step * (self.total - step))

    def _append(self, name: str, records: list[dict]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / name, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))

    def step(self, step: int, metrics: dict, keys) -> None:
        if not self.active:
            return
        parts = [f"{short} {metrics[k]:.4g}" for short, k in keys if k in metrics]
        self.print(f"{self.prefix}step {step}/{self.total} | " + " | ".join(parts)
                   + f" | eta {self.eta(step)}", flush=True)
        self._append("metrics.jsonl", [{"step": step, **metrics}])

    def samples(self, step: int, samples: list[dict], n_print: int = 3) -> None:
        if not (self.active and samples):
            return
        for s in samples[:n_print]:
            prompt = s["prompt"].strip().splitlines()
            self.print(f"  sample: {prompt[-2] if len(prompt) > 1 else prompt[-1]!r} -> "
                       f"{s['response']!r} (truth {s['ground_truth']}, score {s['score']:g})",
                       flush=True)
        self._append("generations.jsonl", [{"step": step, **s} for s in samples])
