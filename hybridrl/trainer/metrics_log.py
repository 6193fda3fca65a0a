"""Step metrics of the PPO loop: one console line per step and ``metrics.jsonl``, rank 0 only.

Contract:
- ``MetricsLog(rank, folder, loggers, print_fn)``: every method is a no-op on ranks other than 0;
  ``folder`` is the run folder (``hybridrl.checkpoint.run_folder``). ``build_metrics_log(cfg, rank,
  print_fn)`` is the trainer's: the run folder of ``cfg.trainer`` and its tracker
  (``hybridrl.trainer.tracking.build_tracker``) as ``open_tracker``.
- ``line(text)`` prints ``text`` (flushed).
- ``step(step, total, metrics)`` prints ``step <step>/<total> | score .. | pg_loss .. | ... |
  eta <m>m<ss>s`` (the keys of ``SUMMARY`` that ``metrics`` has; the ETA is the mean time per
  step since ``resume_at`` times the steps left; then ``| rolled back: not kept`` when the
  step guard undid it, ``training/rolled_back``) and, when ``"jsonl"`` is in ``loggers``, appends
  ``{"step": step, "kept": bool, **metrics}`` as one line to ``<folder>/metrics.jsonl``; the
  ``tracker`` (``hybridrl.trainer.tracking``, when set) receives the metrics too.
- ``resume_at(step)`` moves the lines of steps > ``step`` of ``metrics.jsonl`` and
  ``generations.jsonl`` (steps after the resumed checkpoint, which run again) to
  ``*.redone.jsonl`` with one line saying so (``hybridrl.checkpoint.run_folder.keep_steps_upto``), so a
  resumed run appends to a file of steps 1..N without duplicates and nothing is lost; it also
  calls ``open_tracker`` when set (so ``config.yaml`` and the sinks start only once the run
  folder was accepted).
- ``samples(step, samples)`` prints a few validation generations and appends all of them to
  ``<folder>/generations.jsonl``; ``phase(name)`` prints a start-up phase with its time
  (``hybridrl.trainer.progress``); ``startup(text)`` queues a start-up line (models built,
  engine ready) that is printed, with the first weight sync's time, just before the first step
  line; ``close()`` closes the tracker.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridrl.checkpoint.run_folder import keep_steps_upto
from hybridrl.trainer.progress import Progress

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
        self.progress = Progress(rank, folder, print_fn)
        self.tracker = None  # a hybridrl.trainer.tracking.Tracker on rank 0, when one is chosen
        self.open_tracker = None  # () -> Tracker | None, called by resume_at (folder accepted)
        self.pending: list[str] = []  # start-up lines, printed before the first step line

    def line(self, text: str) -> None:
        if self.active:
            self.print(text, flush=True)

    def step(self, step: int, total: int, metrics: dict) -> None:
        if not self.active:
            return
        parts = [f"{short} {metrics[k]:.4g}" for short, k in SUMMARY if k in metrics]
        kept = not metrics.get("training/rolled_back")
        if self.progress.total == 0 and "timing_s/reshard" in metrics:  # the run's first step
            for text in self.pending:
                self.print(text, flush=True)
            self.pending = []
            self.print(f"hybridrl: first weight sync {metrics['timing_s/reshard']:.2f} s, first "
                       f"step {metrics.get('timing_s/step', float('nan')):.1f} s", flush=True)
        self.progress.total = total
        self.print(f"step {step}/{total} | " + " | ".join(parts)
                   + f" | eta {self.progress.eta(step)}"
                   + ("" if kept else " | rolled back: not kept"), flush=True)
        if self.tracker is not None:
            self.tracker.log(metrics, step)
        if self.jsonl:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps({"step": step, "kept": kept, **metrics}) + "\n"
            with open(self.path, "a") as f:  # one write: a torn line has no newline, and
                f.write(line)  # resume_at moves it aside (run_folder.keep_steps_upto)

    def samples(self, step: int, samples: list[dict]) -> None:
        self.progress.samples(step, samples)

    def phase(self, name: str) -> None:
        self.progress.phase(name)

    def startup(self, text: str) -> None:
        """A start-up line, printed just before the first step's line."""
        self.pending.append(text)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def resume_at(self, step: int) -> None:
        self.progress.start(0, first_step=step)
        if self.open_tracker is not None:  # the run folder is accepted: config.yaml, sinks
            self.tracker, self.open_tracker = self.open_tracker(), None
        if not self.active:
            return
        for path in (self.path, self.path.with_name("generations.jsonl")):
            notices: list[str] = []
            moved = keep_steps_upto(path, step, notices)
            for text in notices:
                self.line(f"hybridrl: warning: {text}")
            if moved:
                self.line(f"hybridrl: {moved} lines of steps after {step} (run again from the "
                          f"checkpoint) moved from {path.name} to {path.stem}.redone.jsonl")


def build_metrics_log(cfg, rank: int, print_fn=print) -> MetricsLog:
    """The trainer's log: ``cfg.trainer.run_dir``, its loggers, the tracker once resumed."""
    import functools

    from hybridrl.trainer.tracking import build_tracker

    t = cfg.trainer
    log = MetricsLog(rank, t.run_dir, t.logger, print_fn)
    log.open_tracker = functools.partial(build_tracker, cfg, rank, t.run_dir)
    return log
