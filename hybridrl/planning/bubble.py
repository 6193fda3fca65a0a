"""The idle share of a 1F1B pipeline (pure; the memory plan, the time plan and the trainer's
start-up lines share it; ``hybridrl.planning.memory`` re-exports these names).

Contract: ``bubble_fraction(pp, m)`` = (pp - 1) / (m + pp - 1) for m micro-batches per
pipeline; ``bubble_report(pp, {role: m})`` gives ``pipeline_bubble`` {role: fraction} of the
roles with m > 0 and, when one exceeds ``BUBBLE_WARN`` (25 %), ``bubble_warning`` naming the
roles, their idle share and counts.
"""

from __future__ import annotations

BUBBLE_WARN = 0.25


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """Idle share of a 1F1B pipeline: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)


def bubble_report(pp: int, micro_batches: dict[str, int]) -> dict:
    """``pipeline_bubble`` {role: fraction} of the roles with micro-batches (> 0) and, when one
    exceeds ``BUBBLE_WARN``, ``bubble_warning`` (the roles, their idle share and counts)."""
    bubbles = {role: bubble_fraction(pp, m) for role, m in micro_batches.items() if m}
    out: dict = {"pipeline_bubble": bubbles} if bubbles else {}
    over = [f"{r} {f:.0%} idle ({micro_batches[r]} micro-batches per pipeline, pp {pp})"
            for r, f in bubbles.items() if f > BUBBLE_WARN]
    if over:
        out["bubble_warning"] = ", ".join(over)
    return out
