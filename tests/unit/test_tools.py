"""Tools (hybridrl/tools): the calculator parses and never evaluates, with bounded cost; a
failing, hanging, huge-output or ill-typed tool becomes output text, a hang killed at its
timeout; the registry refuses bad specs with one line; the python tool runs in the sandbox."""

from __future__ import annotations

import os
import time

import pytest

from hybridrl.tools import ToolRegistry, build_tools, check_arguments, run_tool
from hybridrl.tools.calculator import Calculator


def test_calculator_values():
    calc = build_tools(["calculator"])
    for text, want in [("123456 + 654321", "777777"), ("2*(3+4)", "14"), ("-7 // 2", "-4"),
                       ("7 / 2", "3.5"), ("6 / 3", "2"), ("2 ** 10", "1024"), ("10 % 4", "2")]:
        res = calc.call("calculator", {"expression": text})
        assert (res.text, res.error) == (want, False), text


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')", "open('/etc/passwd')", "(1).__class__", "'a' * 10",
    "[1] * 10", "x + 1", "lambda: 1", "1 if 1 else 2", "9 ** 9 ** 9", "10 ** 99 * 10 ** 99",
    "2 ** 100000", "1 / 0", "1e308 * 10", "(" * 150 + "1" + ")" * 150, "1 +", "9" * 500,
    "+".join(["1"] * 90)])
def test_calculator_refuses_hostile_text_quickly(text):
    t0 = time.perf_counter()
    res = build_tools(["calculator"]).call("calculator", {"expression": text})
    assert res.error and res.text.startswith("error: ") and "\n" not in res.text, res
    assert time.perf_counter() - t0 < 0.5


class _Slow:
    name, description, in_process = "slow", "sleeps", False
    parameters = {"type": "object", "properties": {"pid_file": {"type": "string"}}}
    timeout_s = 0.5

    def call(self, arguments):
        if "pid_file" in arguments:
            with open(arguments["pid_file"], "w") as f:
                f.write(str(os.getpid()))
        time.sleep(60)
        return "late"


class _Boom(_Slow):
    name = "boom"

    def call(self, arguments):
        raise RuntimeError("the tool broke\nwith a second line")


class _Huge(_Slow):
    name, timeout_s = "huge", 5.0

    def call(self, arguments):
        return "x" * 10_000_000


class _NotText(_Slow):
    name = "nottext"

    def call(self, arguments):
        return 42


class _Dies(_Slow):
    name = "dies"

    def call(self, arguments):
        os._exit(3)


def test_hanging_tool_is_killed_at_its_timeout(tmp_path):
    reg = ToolRegistry([_Slow()])
    t0 = time.perf_counter()
    res = reg.call("slow", {"pid_file": str(tmp_path / "pid")})
    took = time.perf_counter() - t0
    assert res.error and res.timed_out and "timed out after 0.5 s" in res.text
    assert 0.5 <= took < 5.0, took
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: nothing left running
        os.kill(pid, 0)


def test_failing_huge_and_wrong_tools_become_output_text():
    reg = ToolRegistry([_Boom(), _Huge(), _NotText(), _Dies()], max_output_chars=100)
    boom = reg.call("boom", {})
    assert boom.error and boom.text == "error: RuntimeError: the tool broke with a second line"
    huge = reg.call("huge", {})
    assert not huge.error and huge.text == "x" * 100 + "[... 9999900 more characters]"
    assert reg.call("nottext", {}).text == "error: tool nottext returned int, not text"
    assert reg.call("dies", {}).text == "error: tool dies died (exit status 3)"
    unknown = reg.call("nope", {})
    assert unknown.error and "no tool named 'nope'" in unknown.text


def test_arguments_are_checked_against_the_schema():
    params = Calculator.parameters
    assert check_arguments(params, {"expression": "1"}) is None
    assert "missing required argument 'expression'" in check_arguments(params, {})
    assert "unknown argument 'x'" in check_arguments(params, {"expression": "1", "x": 2})
    assert "must be string" in check_arguments(params, {"expression": 1})
    assert "JSON object" in check_arguments(params, ["1"])
    res = run_tool(Calculator(), {"expression": 5})
    assert res.error and "must be string" in res.text


def test_registry_refuses_bad_specs_with_one_line():
    for spec, words in [("nope", "unknown tool 'nope'"), ("no.such.module:x", "cannot load"),
                        ("hybridrl.tools.calculator:NotThere", "cannot load")]:
        with pytest.raises(ValueError, match=words) as err:
            build_tools([spec])
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        build_tools(["calculator", "hybridrl.tools.calculator:Calculator"])


def test_python_tool_runs_in_the_sandbox():
    from hybridrl.rewards.sandbox import Sandbox, SandboxUnavailable

    try:
        Sandbox().check()
    except SandboxUnavailable as err:
        with pytest.raises(ValueError, match="python: code reward: the OS sandbox"):
            build_tools(["python"])
        pytest.skip(str(err))
    reg = build_tools(["python"], timeout_s=2.0)
    assert reg.call("python", {"code": "print(2 ** 70)"}).text == "1180591620717411303424\n"
    err = reg.call("python", {"code": "import socket\nsocket.create_connection(('1.1.1.1', 80))"})
    assert "OSError" in err.text or "Error" in err.text
    t0 = time.perf_counter()
    hang = reg.call("python", {"code": "while True: pass"})
    assert "timed out after 2 s" in hang.text and time.perf_counter() - t0 < 10
