"""Rewards 'math' (boxed answer + math-verify) and 'code' (sandboxed execution): correct, wrong,
malformed, timeout and resource-exhaustion cases; assert tests judged outside the sandbox; both
are registered and reach the metrics."""

import builtins
import json
import time

import pytest

from hybridrl.rewards import code as code_reward
from hybridrl.rewards import math as math_reward
from hybridrl.rewards.scoring import REWARD_FNS, RewardScorer

pytest.importorskip("math_verify")

STDIO = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


def _fenced(program: str) -> str:
    return f"Here is my solution:\n```python\n{program}```\nDone."


# ---------------------------------------------------------------- math

@pytest.mark.parametrize("response,truth", [
    (r"... so the answer is $\boxed{\frac{1}{2}}$.", "0.5"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1"),
    (r"first \boxed{3} then corrected: \boxed{\sqrt{4}}", "2"),  # the last box counts
    ("Answer: 42", "42"),
])
def test_math_correct(response, truth):
    assert math_reward.compute_score("math", response, truth) == {
        "score": 1.0, "acc": 1.0, "format_ok": 1.0, "too_complex": 0.0}


@pytest.mark.parametrize("response,truth", [
    (r"\boxed{\frac{1}{3}}", "0.5"), (r"\boxed{x^2+1}", "(x+1)^2"), (r"\boxed{2}", "3"),
])
def test_math_wrong(response, truth):
    assert math_reward.compute_score("math", response, truth) == {
        "score": 0.0, "acc": 0.0, "format_ok": 1.0, "too_complex": 0.0}


@pytest.mark.parametrize("response", [
    r"the answer is \boxed{\frac{1}{2}", "no final answer here", r"\boxed{}", "",
    r"\boxed{" + "1+" * 2000 + "1}",  # longer than MAX_ANSWER_CHARS
])
def test_math_malformed(response):
    assert math_reward.compute_score("math", response, "1")["format_ok"] == 0.0


def test_math_timeout_is_bounded():
    t0 = time.perf_counter()
    out = math_reward.compute_score("math", r"\boxed{9^{9^{9^{9^{9}}}}}", "1", timeout_s=1)
    # ~0 s (screened, not evaluated); 20 s: far above any load, far below evaluating it
    assert out["score"] == 0.0 and time.perf_counter() - t0 < 20


@pytest.mark.parametrize("answer", ["9^{9^{9^{9}}}", "10^{10^{5}}", "2^{10000000}",
                                    "(100000)!"])
def test_math_unbounded_answers_score_zero_in_a_thread(answer):
    """The trainer calls reward functions in a thread (no signal timeout there): answers sympy
    could evaluate forever are scored 0 without evaluating them, well inside the deadline."""
    import threading

    out = {}
    worker = threading.Thread(target=lambda: out.update(
        math_reward.compute_score("math", rf"\boxed{{{answer}}}", "1")), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and out["score"] == 0.0 and out["too_complex"] == 1.0


@pytest.mark.parametrize("answer", ["2^{1000}", "x^5+x^4+x^3+x^2+x+1", "1000!", "x^{2}+y^{3}"])
def test_math_ordinary_powers_are_not_screened(answer):
    assert not math_reward.too_complex(answer)


def test_math_resource_exhaustion_huge_response():
    """A 20 MB response: only the tail is read, so it is scored quickly."""
    t0 = time.perf_counter()
    out = math_reward.compute_score("math", "x" * 20_000_000 + r"\boxed{7}", "7")
    # ~0.1 s (the tail only); 5 s leaves a 50x slowdown to load, parsing all 20 MB takes more
    assert out["score"] == 1.0 and time.perf_counter() - t0 < 5


def test_math_without_math_verify_is_one_line(monkeypatch):
    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name == "math_verify":
            raise ImportError("No module named 'math_verify'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    with pytest.raises(ImportError) as info:
        math_reward.compute_score("math", r"\boxed{1}", "1")
    assert "\n" not in str(info.value) and "hybridrl[math]" in str(info.value)


# ---------------------------------------------------------------- code

def test_code_correct_stdio_and_assert():
    out = code_reward.compute_score("code", _fenced(ADD), STDIO)
    assert out["score"] == 1.0 and out["pass_rate"] == 1.0
    assert all(out[f"fail/{r}"] == 0.0 for r in code_reward.REASONS)
    asserts = {"assert": "assert add(2, 3) == 5\nassert add(-1, 1) == 0"}
    assert code_reward.compute_score(
        "code", _fenced("def add(a, b):\n    return a + b\n"), asserts)["score"] == 1.0


@pytest.mark.parametrize("program,tests,reason", [
    ("a, b = map(int, input().split())\nprint(a - b)\n", STDIO, "wrong_answer"),
    ("def add(a, b):\n    return a - b\n", {"assert": "assert add(2, 3) == 5"}, "wrong_answer"),
    ("print(\n", STDIO, "syntax_error"),
    ("raise ValueError('boom')\n", STDIO, "runtime_error"),
])
def test_code_wrong(program, tests, reason):
    res = code_reward.run_tests(program, tests, timeout_s=5)
    assert (res.score, res.reason) == (0.0, reason) and res.detail


def test_code_partial_pass_rate():
    tricky = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "8\n"]})
    res = code_reward.run_tests(ADD, tricky)
    assert (res.score, res.pass_rate, res.reason) == (0.0, 0.5, "wrong_answer")


@pytest.mark.parametrize("response", ["no code at all", "```python\n\n```", "```js\nx\n```"])
def test_code_malformed_response(response):
    out = code_reward.compute_score("code", response, STDIO)
    assert out["score"] == 0.0 and out["fail/no_code"] == 1.0


def test_code_malformed_tests_are_an_error():
    with pytest.raises(ValueError, match="ground_truth must be"):
        code_reward.compute_score("code", _fenced(ADD), {"cases": []})
    with pytest.raises(ValueError, match="not JSON"):
        code_reward.compute_score("code", _fenced(ADD), "{not json")


@pytest.mark.parametrize("program", ["while True:\n    pass\n",
                                     "import time\ntime.sleep(60)\n"])
def test_code_timeout(program):
    t0 = time.perf_counter()
    res = code_reward.run_tests(program, STDIO, timeout_s=1)
    # killed at timeout_s (~1 s), not after the 60 s sleep (or never); 9 s left for load
    assert res.reason == "timeout" and time.perf_counter() - t0 < 10


@pytest.mark.parametrize("program,reason", [
    ("x = bytearray(4 * 1024 ** 3)\n", "memory"),
    ("x = []\nwhile True:\n    x.append(' ' * 10 ** 6)\n", "memory"),
    ("while True:\n    print('x' * 1000)\n", "output_limit"),
    ("while True:\n    open('big.txt', 'a').write('x' * 10 ** 6)\n", "output_limit"),
])
def test_code_resource_exhaustion(program, reason):
    res = code_reward.run_tests(program, STDIO, timeout_s=5, memory_mb=256,
                                max_output_bytes=1 << 20)
    assert res.reason == reason, res


def test_code_writes_stay_in_its_sandbox(tmp_path):
    """Writes outside fail (the host's folders are not there); its own /work and /tmp work.
    Hostile programs: tests/unit/test_sandbox_adversarial.py."""
    target = tmp_path / "outside.txt"
    for program in (f"open({str(target)!r}, 'w').write('x')\n",
                    f"import os\nos.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)\n"):
        assert code_reward.run_tests(program, STDIO).reason == "runtime_error", program
    assert not target.exists() and tmp_path.exists()
    ok = "open('scratch.txt', 'w').write('x')\nopen('/tmp/t', 'w').write('x')\n" + ADD
    assert code_reward.run_tests(ok, STDIO).score == 1.0


def test_code_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("HYBRIDRL_SECRET_TOKEN", "s3cret")
    program = "import os\nprint('LEAK' if 'HYBRIDRL_SECRET_TOKEN' in os.environ else 'clean')\n"
    tests = {"inputs": [""], "outputs": ["clean"]}
    assert code_reward.run_tests(program, tests).score == 1.0


@pytest.mark.parametrize("tests,reason", [
    ({"assert": "assert add(1, 2) > 2"}, "assert CALL == LITERAL"),
    ({"assert": "x = 1"}, "no assert statement"),
    ({"assert": "assert (\n"}, "do not parse"),
])
def test_code_assert_tests_outside_the_convertible_forms_are_an_error(tests, reason):
    with pytest.raises(ValueError, match=reason):
        code_reward.parse_tests(tests)


def test_code_assert_tests_become_calls_and_expected_values():
    spec = code_reward.parse_tests({"assert": "import math\nassert add(1, 2) == 3\n"
                                              "assert [1] == f(x)\nassert ok(1)\nassert not ok(2)"})
    assert spec.kind == "calls" and spec.setup == "import math"
    assert spec.cases == [("add(1, 2)", 3, "eq"), ("f(x)", [1], "eq"), ("ok(1)", True, "truthy"),
                          ("ok(2)", False, "falsy")]
    program = "def ok(n):\n    return n == 1\ndef add(a, b):\n    return a + b\n" \
              "def f(x):\n    return [1]\nx = 0\n"
    assert code_reward.run_tests(program, {"assert": "assert add(1, 2) == 3\nassert [1] == f(x)\n"
                                                     "assert ok(1)\nassert not ok(2)"}).score == 1
    res = code_reward.run_tests("def add(a, b):\n    return object()\n",
                                {"assert": "assert add(1, 2) == 3"})
    assert (res.score, res.reason) == (0.0, "wrong_answer") and "not a literal" in res.detail


# ---------------------------------------------------------------- registry and metrics

def test_math_and_code_registered_and_reasons_reach_metrics():
    assert {"math", "code"} <= set(REWARD_FNS.names())
    scores, metrics = RewardScorer().score_batch(
        [r"\boxed{4}", r"\boxed{5}", _fenced(ADD), "no code"], ["4", "4", STDIO, STDIO],
        ["math", "math", "code", "code"])
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert metrics["reward/source/math/mean"] == 0.5
    assert metrics["reward/fail/no_code/mean"] == 0.5  # over the rows reporting it (code rows)


def test_overlong_shaping_in_the_scorer():
    scorer = RewardScorer(overlong_buffer=4, overlong_penalty_factor=1.0)
    scores, metrics = scorer.score_batch(["a", "b"], ["1", "1"], ["hybridrl/arithmetic"] * 2,
                                         response_ids=[[0] * 6, [0] * 10], max_response_length=10)
    # 6 tokens: expected 10 - 4 = 6 -> 0; 10 tokens: -(10 - 6)/4 = -1
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(-0.5)
    assert scores[1].item() == pytest.approx(scores[0].item() - 1.0)
