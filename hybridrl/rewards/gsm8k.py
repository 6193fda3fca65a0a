"""GSM8K rule reward, with verl's semantics (a user switching must see the same scores).

Contract. Only the last 300 characters of the response are searched.
  strict:   matches of ``#### (-?[0-9.,]+)``; the last one, with "," and "$" removed, is the answer.
  flexible: matches of ``(-?[0-9.,]+)``; the last one that is not "" or "." is the answer
            (verbatim, nothing stripped).
``compute_score`` returns ``score`` (1.0) when the answer equals ``ground_truth`` as a string,
``format_score`` (0.0) when an answer was found but differs, and 0.0 when none was found.
"""

from __future__ import annotations

import re
from typing import Any

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
METHODS = ("strict", "flexible")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer string found in ``solution_str`` by ``method``, or None."""
    if method not in METHODS:
        raise ValueError(f"gsm8k method={method!r}; allowed: {METHODS}")
    text = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_NUMBER.findall(text)):
        if candidate not in ("", "."):
            return candidate
    return None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl-signature GSM8K score (see module docstring)."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth) else float(format_score)
