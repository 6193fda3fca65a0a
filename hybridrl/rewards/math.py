"""MATH-style rule reward: the final answer (last ``\\boxed{...}``) checked against the ground truth,
first as text, then for symbolic equivalence by ``math-verify`` (an optional dependency: ``pip
install 'hybridrl[math]'``; missing, the call raises one ImportError line).

Contract (verl signature, registered for data_source ``math``):
- only the last ``TAIL_CHARS`` characters of the response are searched, in linear time; the
  answer is the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces, else
  the text after the last ``Answer:`` / ``final answer is`` on its line; an answer longer than
  ``MAX_ANSWER_CHARS`` counts as malformed;
- ``compute_score`` returns ``{"score": 1.0 | 0.0, "acc": same, "format_ok": 1.0 | 0.0,
  "too_complex": 1.0 | 0.0}`` (``too_complex`` absent when no answer was found). In order:
  no answer: 0 (format_ok 0); the answer equal to the gold after ``normalize`` (spaces, ``$``,
  ``\\left``/``\\right``, thin spaces, ``\\dfrac``/``\\tfrac``, a final period): 1.0 without any
  symbolic work, so nothing below can zero an answer equal to the gold; an answer
  ``too_complex`` screens as one sympy may not finish (a numeric power tower, an exponent of 7+
  digits or a product of 4+-digit numbers, a factorial of 5+ digits or of a factorial,
  ``\\binom`` of 6+ digits, brackets nested deeper than ``MAX_DEPTH``): 0 with too_complex 1;
  else ``math_verify.verify(parse(gold), parse(answer))`` in a worker process
  (``MathVerifier``): 1.0 when it holds, 0.0 when not, and 0.0 with too_complex 1 when it has
  not answered within ``timeout_s`` of wall time; then the worker is killed (a hard kill, from
  any thread: no signals) and restarted for the next call.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import select
import subprocess
import sys
import threading
import weakref
from typing import Any

TAIL_CHARS = 10_000
MAX_ANSWER_CHARS = 1_000
MAX_DEPTH = 50
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_RISKY = (re.compile(r"\d\s*\^\s*\{?\s*[(\d][^{}]*\^"),  # 9^{9^{9}}: a numeric power tower
          re.compile(r"\^\s*\{?\s*\d{7,}"),  # 2^{10000000}
          re.compile(r"\^\s*\{[^{}]*\d{4,}[^{}]*(?:\\cdot|\\times|\*|\^)[^{}]*\d{4,}"),
          re.compile(r"\d{5,}\s*\)?\s*!"),  # (100000)!
          re.compile(r"!\s*[)}]\s*!"),  # (10!)!
          re.compile(r"\\[dt]?binom\s*\{\s*\d{6,}"))
_ANSWER_LINE = re.compile(r"(?:Answer\s*:|final answer is)\s*\$?([^\n$]+)", re.IGNORECASE)
_NOISE = re.compile(r"\s+|\$|\\left|\\right|\\[,;:! ]")
_WORKER = ("import json, sys\n"
           "import math_verify as mv\n"
           "print('ready', flush=True)\n"
           "for line in sys.stdin:\n"
           "    gold, answer = json.loads(line)\n"
           "    try:\n"
           "        g = mv.parse(gold, parsing_timeout=None)\n"
           "        a = mv.parse(answer, parsing_timeout=None)\n"
           "        ok = bool(g and a and mv.verify(g, a, timeout_seconds=None))\n"
           "    except Exception:\n"
           "        ok = False\n"
           "    print(json.dumps(ok), flush=True)\n")


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError("reward 'math' needs math-verify: pip install 'hybridrl[math]' "
                          "(or pip install math-verify)") from None
    return math_verify


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces; None when absent or unclosed.
    One pass over ``text``: each ``{`` is pushed, each ``}`` closes the innermost one."""
    starts = {m.end() - 1 for m in _BOXED.finditer(text)}  # index of each box's own "{"
    if not starts:
        return None
    stack, best = [], None
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            opened = stack.pop()
            if opened in starts and (best is None or opened > best[0]):
                best = (opened, i)
    return text[best[0] + 1:best[1]].strip() if best else None


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


def normalize(answer: str) -> str:
    """The answer's text for the equality check (see the module docstring)."""
    text = _NOISE.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.rstrip(".")


def _depth(text: str) -> int:
    depth = peak = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            peak = max(peak, depth)
        elif ch in ")]}":
            depth -= 1
    return peak


def too_complex(answer: str) -> bool:
    """True for answers whose evaluation may not finish (see the module docstring)."""
    return _depth(answer) > MAX_DEPTH or any(p.search(answer) for p in _RISKY)


def _stop_worker(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):  # a pipe to a killed worker may refuse its flush
            pipe.close()


class MathVerifier:
    """One math-verify worker process; each call bounded by ``timeout_s`` and a hard kill."""

    def __init__(self, start_timeout_s: float = 120.0) -> None:
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _readline(self, timeout_s: float) -> str | None:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        return self._proc.stdout.readline() if ready else None

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, bufsize=1)
        self._stop = weakref.finalize(self, _stop_worker, self._proc)  # also at exit
        if (self._readline(self.start_timeout_s) or "").strip() != "ready":
            self.close()
            raise RuntimeError(f"math reward: the math-verify worker did not start within "
                               f"{self.start_timeout_s:g} s")

    def close(self) -> None:
        if self._proc is not None:
            self._stop()
            self._proc = None

    def verify(self, answer: str, gold: str, timeout_s: float) -> bool | None:
        """math-verify's verdict on ``answer`` against ``gold``; None past ``timeout_s``."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            self._proc.stdin.write(json.dumps([f"\\boxed{{{gold}}}", f"\\boxed{{{answer}}}"])
                                   + "\n")
            self._proc.stdin.flush()
            line = self._readline(timeout_s)
            if line is None or not line.strip():
                self.close()  # stuck in sympy (or dead): killed, restarted by the next call
                return None
            return bool(json.loads(line))


@functools.lru_cache(maxsize=1)
def default_verifier() -> MathVerifier:
    """The process's math-verify worker (started on the first symbolic comparison)."""
    return MathVerifier()


def is_equivalent(answer: str, ground_truth: str, timeout_s: float = 5) -> bool | None:
    """Equal after ``normalize``, else math-verify's verdict; None past ``timeout_s``."""
    if normalize(answer) == normalize(ground_truth):
        return True
    return default_verifier().verify(answer, ground_truth, timeout_s)


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None, timeout_s: float = 5) -> dict[str, float]:
    """verl-signature MATH score (see the module docstring)."""
    _math_verify()  # a missing dependency is an error, not a zero score
    answer = extract_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "format_ok": 0.0}
    gold = str(ground_truth).strip()
    if normalize(answer) == normalize(gold):
        return {"score": 1.0, "acc": 1.0, "format_ok": 1.0, "too_complex": 0.0}
    if too_complex(answer):
        return {"score": 0.0, "acc": 0.0, "format_ok": 1.0, "too_complex": 1.0}
    verdict = default_verifier().verify(answer, gold, timeout_s)
    ok = float(bool(verdict))
    return {"score": ok, "acc": ok, "format_ok": 1.0, "too_complex": float(verdict is None)}
