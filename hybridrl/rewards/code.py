"""Code-execution reward: the response's program run against the row's tests under limits.

Contract (verl signature, registered for data_source ``code``):
- the program is the last fenced block (```python ... ``` or ``` ... ```) of the response;
  none = malformed (reason ``no_code``);
- ``ground_truth`` (a dict or its JSON text) holds the tests, either stdin/stdout cases
  ``{"inputs": [str, ...], "outputs": [str, ...]}`` (each case one run; stdout compared with
  the expected text, trailing whitespace of each line and surrounding blank lines ignored) or
  ``{"assert": "<python code>"}`` run after the program in the same process (one run). Tests in
  another shape raise ValueError naming the keys (the data set is wrong, not the response);
- each run: ``python -I hybridrl/rewards/code_sandbox.py`` in a fresh temp dir (its cwd, HOME
  and TMPDIR; deleted afterwards), a minimal environment, no network (``unshare -rn`` when this
  machine allows it, and the sandbox's audit hook always), address space ``memory_mb``, CPU and
  wall time ``timeout_s``, files (stdout included) ``max_output_bytes``; runs stop at the first
  failing case;
- ``run_tests(code, tests, ...) -> CodeResult(score, pass_rate, reason, detail)``: score 1.0
  when every case passes, else 0.0; ``reason`` one of ``REASONS`` ("" when passed), ``detail``
  a short line (the first stderr line or the mismatch);
- ``compute_score`` returns ``{"score", "pass_rate", "fail/<reason>": 0|1 for each reason}``, so
  the metrics show why responses fail (``reward/fail/timeout/mean``, ...).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

REASONS = ("no_code", "syntax_error", "runtime_error", "wrong_answer", "timeout", "memory",
           "output_limit", "sandbox")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_SANDBOX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_sandbox.py")


@dataclass(frozen=True)
class CodeResult:
    score: float
    pass_rate: float
    reason: str
    detail: str = ""


def extract_code(solution_str: str) -> str | None:
    """The last fenced code block of the response (python or unlabeled), or None."""
    blocks = [body for lang, body in _FENCE.findall(solution_str)
              if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks and blocks[-1].strip() else None


def parse_tests(tests: Any) -> list[tuple[str, str | None]]:
    """[(stdin, expected stdout or None for assert-style)], from a dict or JSON text."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as err:
            raise ValueError(f"code reward: ground_truth is not JSON ({err.msg})") from None
    if isinstance(tests, dict) and isinstance(tests.get("assert"), str):
        return [("", None)]
    if (isinstance(tests, dict) and isinstance(tests.get("inputs"), list)
            and isinstance(tests.get("outputs"), list)
            and len(tests["inputs"]) == len(tests["outputs"]) and tests["inputs"]):
        return [(str(i), str(o)) for i, o in zip(tests["inputs"], tests["outputs"])]
    raise ValueError("code reward: ground_truth must be {'inputs': [...], 'outputs': [...]} "
                     "(same non-zero length) or {'assert': '<python code>'}; got "
                     f"{type(tests).__name__} with keys {sorted(tests) if isinstance(tests, dict) else []}")


@functools.lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """``("unshare", "-rn")`` when an unprivileged network namespace works here, else ()."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (exe, "-rn") if ok else ()


def _same_output(got: str, expected: str) -> bool:
    def norm(text):
        return "\n".join(line.rstrip() for line in text.strip().splitlines())
    return norm(got) == norm(expected)


def _classify(rc: int, stderr: str) -> str:
    if rc in (-signal.SIGXCPU, -signal.SIGKILL) and "MemoryError" not in stderr:
        return "timeout"
    if rc == -signal.SIGXFSZ or "File too large" in stderr:
        return "output_limit"
    if "MemoryError" in stderr or rc == -signal.SIGSEGV:
        return "memory"
    if "PermissionError: sandbox:" in stderr:
        return "sandbox"
    if "SyntaxError" in stderr or "IndentationError" in stderr:
        return "syntax_error"
    return "runtime_error"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _run_once(program: str, stdin: str, timeout_s: float, limits: dict) -> tuple[str, str, str]:
    """(reason or "", stdout, detail) of one sandboxed run."""
    work = tempfile.mkdtemp(prefix="hybridrl-code-")
    try:
        with open(os.path.join(work, "solution.py"), "w", encoding="utf-8") as f:
            f.write(program)
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        cmd = [*network_namespace_prefix(), sys.executable, "-I", _SANDBOX, json.dumps(limits),
               "solution.py"]
        out_path, err_path = os.path.join(work, ".stdout"), os.path.join(work, ".stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.PIPE, stdout=out,
                                    stderr=err, start_new_session=True)
            try:
                proc.communicate(stdin.encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return "timeout", "", f"no exit within {timeout_s:g} s"
        cap = limits["max_file_bytes"]
        with open(out_path, "rb") as f:
            stdout = f.read(cap).decode("utf-8", "replace")
        with open(err_path, "rb") as f:
            stderr = f.read(cap).decode("utf-8", "replace")
        if proc.returncode != 0:
            return _classify(proc.returncode, stderr), stdout, _last_line(stderr) or (
                f"exit status {proc.returncode}")
        return "", stdout, ""
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_tests(program: str, tests: Any, *, timeout_s: float = 5.0, memory_mb: int = 512,
              max_output_bytes: int = 1 << 20) -> CodeResult:
    """Run ``program`` against ``tests`` (see the module docstring)."""
    cases = parse_tests(tests)
    if isinstance(tests, str):
        tests = json.loads(tests)
    limits = {"memory_mb": int(memory_mb), "cpu_s": max(1, int(timeout_s + 0.999)),
              "max_file_bytes": int(max_output_bytes)}
    passed = 0
    for stdin, expected in cases:
        source = program if expected is not None else program + "\n\n" + tests["assert"] + "\n"
        reason, stdout, detail = _run_once(source, stdin, timeout_s, limits)
        if not reason and expected is not None and not _same_output(stdout, expected):
            reason, detail = "wrong_answer", f"case {passed}: expected {expected.strip()[:80]!r}, " \
                                             f"got {stdout.strip()[:80]!r}"
        if reason == "runtime_error" and expected is None and detail.startswith("AssertionError"):
            reason = "wrong_answer"  # the row's asserts failed: a wrong program, not a crash
        if reason:
            return CodeResult(0.0, passed / len(cases), reason, detail)
        passed += 1
    return CodeResult(1.0, 1.0, "")


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None, timeout_s: float = 5.0, memory_mb: int = 512,
                  max_output_bytes: int = 1 << 20) -> dict[str, float]:
    """verl-signature code score (see the module docstring)."""
    program = extract_code(solution_str)
    if program is None:
        parse_tests(ground_truth)  # a broken test spec is an error even without code
        result = CodeResult(0.0, 0.0, "no_code")
    else:
        result = run_tests(program, ground_truth, timeout_s=timeout_s, memory_mb=memory_mb,
                           max_output_bytes=max_output_bytes)
    out = {"score": result.score, "pass_rate": result.pass_rate}
    out.update({f"fail/{r}": float(result.reason == r) for r in REASONS})
    return out
