"""MATH-style rule reward: the final answer (last ``\\boxed{...}``) checked for symbolic
equivalence with the ground truth by ``math-verify`` (an optional dependency: ``pip install
'hybridrl[math]'``, imported on the first call; missing, the call raises one ImportError line).

Contract (verl signature, registered for data_source ``math``):
- only the last ``TAIL_CHARS`` characters of the response are searched; the answer is the content
  of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces, else the text after the last
  ``Answer:`` / ``final answer is`` on its line; an answer longer than ``MAX_ANSWER_CHARS`` counts
  as malformed;
- ``compute_score`` returns ``{"score": 1.0 | 0.0, "acc": same, "format_ok": 1.0 | 0.0,
  "too_complex": 1.0 | 0.0}`` (``too_complex`` absent when no answer was found):
  1.0 when ``math_verify.verify(parse(gold), parse(answer))`` holds (gold and answer are both
  parsed as ``\\boxed{...}``), 0.0 when it does not, when no answer was found (format_ok 0), or
  when parsing / verifying runs past ``timeout_s`` (math-verify's own signal timeout, used in the
  main thread only: the trainer calls reward functions in a thread, which has no signals);
- answers sympy could spend unbounded time on score 0 without being evaluated (``too_complex``
  1.0): a power tower (an exponent containing ``^``), an exponent of 6+ digits, a factorial of
  5+ digits. math-verify's timeout would give them 0 in verl too; here they cannot
  hang a thread until ``reward.timeout_s`` stops the run.
"""

from __future__ import annotations

import re
import threading
from typing import Any

TAIL_CHARS = 10_000
MAX_ANSWER_CHARS = 1_000
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_RISKY = (re.compile(r"\^\s*\{[^{}]*\^"), re.compile(r"\^\s*\{?\s*\d{6,}"),
          re.compile(r"\d{5,}\s*\)?\s*!"))
_ANSWER_LINE = re.compile(r"(?:Answer\s*:|final answer is)\s*\$?([^\n$]+)", re.IGNORECASE)


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError("reward 'math' needs math-verify: pip install 'hybridrl[math]' "
                          "(or pip install math-verify)") from None
    return math_verify


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces; None when absent or unclosed."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start:i - 1].strip()
    return None


def extract_answer(solution_str: str) -> str | None:
    """The final answer of a response (see the module docstring), or None."""
    tail = solution_str[-TAIL_CHARS:]
    answer = last_boxed(tail)
    if answer is None:
        lines = _ANSWER_LINE.findall(tail)
        answer = lines[-1].strip().rstrip(".") if lines else None
    if not answer or len(answer) > MAX_ANSWER_CHARS:
        return None
    return answer


def too_complex(answer: str) -> bool:
    """True for answers whose evaluation may not finish (see the module docstring)."""
    return any(p.search(answer) for p in _RISKY)


def is_equivalent(answer: str, ground_truth: str, timeout_s: int | None = 5) -> bool:
    """math-verify equivalence of two answers (False on a timeout or a parse failure)."""
    mv = _math_verify()
    if threading.current_thread() is not threading.main_thread():
        timeout_s = None  # signal-based timeouts need the main thread
    gold = mv.parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout_s)
    pred = mv.parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)
    if not gold or not pred:
        return False
    return bool(mv.verify(gold, pred, timeout_seconds=timeout_s))


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None, timeout_s: int = 5) -> dict[str, float]:
    """verl-signature MATH score (see the module docstring)."""
    _math_verify()  # a missing dependency is an error, not a zero score
    answer = extract_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "format_ok": 0.0}
    if too_complex(answer):
        return {"score": 0.0, "acc": 0.0, "format_ok": 1.0, "too_complex": 1.0}
    ok = float(is_equivalent(answer, str(ground_truth).strip(), timeout_s))
    return {"score": ok, "acc": ok, "format_ok": 1.0, "too_complex": 0.0}
