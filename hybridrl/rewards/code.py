"""Code-execution reward: the response's program run against the row's tests, isolated by the OS.

Contract (verl signature, registered for data_source ``code``):
- the program is the last fenced block (```python ... ``` or ``` ... ```) of the response;
  none = malformed (reason ``no_code``);
- ``ground_truth`` (a dict or its JSON text) holds the tests, either stdin/stdout cases
  ``{"inputs": [str, ...], "outputs": [str, ...]}`` (each case one run; stdout compared with
  the expected text, trailing whitespace of each line and surrounding blank lines ignored) or
  ``{"assert": "<python code>"}``, converted here (``assert_cases``) to calls and expected
  values: ``assert CALL == LITERAL`` (either side the literal), ``assert CALL`` (truthy) and
  ``assert not CALL`` (falsy); other statements (imports, helpers) are setup run before the
  calls. Any other assert, or tests in another shape, raise ValueError naming it (the data set
  is wrong, not the response);
- tests are judged outside: only inputs enter the sandbox (stdin; the calls and the setup), the
  candidate's outputs come back (stdout; each call's ``repr`` through
  ``hybridrl.rewards.sandbox_harness``, read with ``ast.literal_eval``) and are compared here
  with the expected ones, which never enter it. An exit before every call returned, a crash, a
  non-zero exit status or a missing or non-literal result fails;
- each run: ``hybridrl.rewards.sandbox.Sandbox`` (new user/PID/network/mount/IPC/UTS namespaces,
  a private tmpfs as the only writable place, no view of the host's files but ``/usr`` and the
  interpreter, rlimits, no capabilities, seccomp), address space ``memory_mb``, CPU and wall
  time ``timeout_s``, files (stdout included) ``max_output_bytes``, ``max_processes`` tasks;
  the program runs under the base interpreter with ``-I -S`` (the standard library only);
  stdin/stdout runs stop at the first failing case; reason ``sandbox``: the sandbox could not
  be built for that run. Where the sandbox cannot start, the first
  call raises ``SandboxUnavailable`` (one line): no candidate runs with weaker isolation;
- ``run_tests(code, tests, ...) -> CodeResult(score, pass_rate, reason, detail)``: score 1.0
  when every case passes, else 0.0; ``reason`` one of ``REASONS`` ("" when passed), ``detail``
  a short line (the last stderr line or the mismatch);
- ``compute_score`` returns ``{"score", "pass_rate", "fail/<reason>": 0|1 for each reason}``, so
  the metrics show why responses fail (``reward/fail/timeout/mean``, ...).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import signal
from dataclasses import dataclass
from typing import Any

from hybridrl.rewards import sandbox_harness
from hybridrl.rewards.sandbox import SETUP_FAILED, RunResult, Sandbox

REASONS = ("no_code", "syntax_error", "runtime_error", "wrong_answer", "timeout", "memory",
           "output_limit", "sandbox")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_HARNESS = os.path.abspath(sandbox_harness.__file__)
_ASSERT_FORMS = ("'assert CALL == LITERAL', 'assert CALL' or 'assert not CALL'")


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


@dataclass(frozen=True)
class CaseSpec:
    """stdio: ``cases`` [(stdin, expected stdout)]; calls: ``cases`` [(expression, expected
    value, "eq" | "truthy" | "falsy")] run after ``setup``."""
    kind: str
    cases: list
    setup: str = ""


def assert_cases(code: str) -> CaseSpec:
    """An assert-style test list as calls and expected values (see the module docstring)."""
    try:
        tree = ast.parse(code)
    except SyntaxError as err:
        raise ValueError(f"code reward: the assert tests do not parse (line {err.lineno}: "
                         f"{err.msg})") from None
    setup, cases = [], []
    for node in tree.body:
        if not isinstance(node, ast.Assert):
            setup.append(ast.unparse(node))
            continue
        test, case = node.test, None
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            for call, lit in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
                try:
                    case = (ast.unparse(call), ast.literal_eval(lit), "eq")
                    break
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    continue
        elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            case = (ast.unparse(test.operand), False, "falsy")
        elif not isinstance(test, (ast.Compare, ast.BoolOp)):
            case = (ast.unparse(test), True, "truthy")
        if case is None:
            raise ValueError(f"code reward: assert tests must be {_ASSERT_FORMS}; got "
                             f"{ast.unparse(node)[:120]!r}")
        cases.append(case)
    if not cases:
        raise ValueError("code reward: the assert tests hold no assert statement")
    return CaseSpec("calls", cases, "\n".join(setup))


def parse_tests(tests: Any) -> CaseSpec:
    """The row's tests (a dict or JSON text; see the module docstring)."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as err:
            raise ValueError(f"code reward: ground_truth is not JSON ({err.msg})") from None
    if isinstance(tests, dict) and isinstance(tests.get("assert"), str):
        return assert_cases(tests["assert"])
    if (isinstance(tests, dict) and isinstance(tests.get("inputs"), list)
            and isinstance(tests.get("outputs"), list)
            and len(tests["inputs"]) == len(tests["outputs"]) and tests["inputs"]):
        return CaseSpec("stdio", [(str(i), str(o)) for i, o in zip(tests["inputs"],
                                                                    tests["outputs"])])
    raise ValueError("code reward: ground_truth must be {'inputs': [...], 'outputs': [...]} "
                     "(same non-zero length) or {'assert': '<python code>'}; got "
                     f"{type(tests).__name__} with keys {sorted(tests) if isinstance(tests, dict) else []}")


@functools.lru_cache(maxsize=1)
def default_sandbox() -> Sandbox:
    """The process's sandbox (its start-up check runs once)."""
    return Sandbox()


def _same_output(got: str, expected: str) -> bool:
    def norm(text):
        return "\n".join(line.rstrip() for line in text.strip().splitlines())
    return norm(got) == norm(expected)


def _classify(res: RunResult, stderr: str) -> str:
    rc = res.returncode
    if res.timed_out:
        return "timeout"
    if rc == SETUP_FAILED and "hybridrl-sandbox:" in stderr:
        return "sandbox"
    if rc in (-signal.SIGXCPU, -signal.SIGKILL) and "MemoryError" not in stderr:
        return "timeout"
    if rc == -signal.SIGXFSZ or "File too large" in stderr:
        return "output_limit"
    if "MemoryError" in stderr or rc == -signal.SIGSEGV:
        return "memory"
    if "SyntaxError" in stderr or "IndentationError" in stderr:
        return "syntax_error"
    return "runtime_error"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _failure(res: RunResult, timeout_s: float) -> tuple[str, str] | None:
    """(reason, detail) of a run that did not end cleanly, else None."""
    if res.returncode == 0 and not res.timed_out:
        return None
    stderr = res.stderr.decode("utf-8", "replace")
    reason = _classify(res, stderr)
    detail = (f"no exit within {timeout_s:g} s" if res.timed_out
              else _last_line(stderr) or f"exit status {res.returncode}")
    return reason, detail


def _results(raw: bytes, n: int) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and isinstance(item.get("i"), int) and 0 <= item["i"] < n:
            out.setdefault(item["i"], item)
    return out


def _judge_call(item: dict | None, expected: Any, how: str) -> str:
    """"" when the call's result is the expected one, else why not."""
    if item is None:
        return "no result (the program exited before the call returned)"
    if "error" in item:
        return str(item["error"])[:200]
    try:
        got = ast.literal_eval(str(item.get("repr")))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return f"result {str(item.get('repr'))[:80]} is not a literal"
    ok = {"eq": lambda: got == expected, "truthy": lambda: bool(got),
          "falsy": lambda: not got}[how]()
    return "" if ok else f"expected {expected!r:.80}, got {got!r:.80}"


def run_tests(program: str, tests: Any, *, timeout_s: float = 5.0, memory_mb: int = 512,
              max_output_bytes: int = 1 << 20, max_processes: int = 8,
              sandbox: Sandbox | None = None) -> CodeResult:
    """Run ``program`` against ``tests`` (see the module docstring)."""
    spec = parse_tests(tests)
    box = sandbox or default_sandbox()
    limits = {"memory_mb": int(memory_mb), "cpu_s": max(1, int(timeout_s + 0.999)),
              "max_file_bytes": int(max_output_bytes), "max_open_files": 64,
              "max_processes": int(max_processes)}
    source = program.encode("utf-8", "replace")
    n = len(spec.cases)
    if spec.kind == "calls":
        with open(_HARNESS, "rb") as f:
            files = {"solution.py": source, "harness.py": f.read(),
                     "calls.json": json.dumps({"setup": spec.setup,
                                               "calls": [c[0] for c in spec.cases]}).encode()}
        res = box.run(["python", "-I", "-S", "harness.py"], files, b"", limits, timeout_s)
        failed = _failure(res, timeout_s)
        if failed:
            return CodeResult(0.0, 0.0, *failed)
        got = _results(res.result, n)
        for k, (_, expected, how) in enumerate(spec.cases):
            why = _judge_call(got.get(k), expected, how)
            if why:
                reason = "runtime_error" if k not in got or "error" in got[k] else "wrong_answer"
                return CodeResult(0.0, k / n, reason, f"case {k}: {why}")
        return CodeResult(1.0, 1.0, "")
    for k, (stdin, expected) in enumerate(spec.cases):
        res = box.run(["python", "-I", "-S", "solution.py"], {"solution.py": source},
                      stdin.encode(), limits, timeout_s)
        failed = _failure(res, timeout_s)
        stdout = res.stdout.decode("utf-8", "replace")
        if not failed and not _same_output(stdout, expected):
            failed = ("wrong_answer", f"case {k}: expected {expected.strip()[:80]!r}, "
                                      f"got {stdout.strip()[:80]!r}")
        if failed:
            return CodeResult(0.0, k / n, *failed)
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
