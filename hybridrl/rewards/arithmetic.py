"""Reward of the synthetic addition task (hybridrl.data.arithmetic): exact answer after "####".

Contract. The answer is the last ``#### <integer>`` in the last 300 characters of the response.
Score: ``score`` (1.0) when it equals ``ground_truth`` as an integer; ``format_score`` (default 0.0,
set e.g. 0.1 to reward the format alone) when an answer is present but wrong; 0.0 without one.
"""

from __future__ import annotations

import re
from typing import Any

_ANSWER = re.compile(r"####\s*(-?\d+)")


def extract_answer(solution_str: str) -> int | None:
    found = _ANSWER.findall(solution_str[-300:])
    return int(found[-1]) if found else None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl-signature score of one addition answer (see module docstring)."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    try:
        truth = int(str(ground_truth).strip())
    except ValueError as exc:
        raise ValueError(
            f"{data_source}: ground_truth {ground_truth!r} is not an integer; allowed: e.g. '42'"
        ) from exc
    return float(score) if answer == truth else float(format_score)
