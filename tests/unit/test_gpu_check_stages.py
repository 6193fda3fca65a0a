"""scripts/gpu_stages.py without a GPU: the readers of the stages' output (bandwidth rows, pytest
lines, the compute-sanitizer probe and tools), the sanitize stage with a fake compute-sanitizer on
PATH, and its time sharing among the tools on a fake clock with a fake command runner (no
subprocess, so no timing depends on this machine's load)."""

import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check as gc  # noqa: E402
import gpu_plan as gp  # noqa: E402
import gpu_stages as gs  # noqa: E402


def test_bandwidth_lines_read_benchmarks_kernels_rows():
    from benchmarks import kernels as bk

    old, bk.PEAK_GBS = bk.PEAK_GBS, 4800.0
    try:
        rows = [bk._row("gae", 4096, 8192, 1.0e-4, 5e-2, 5 * 4096 * 8192 * 4),  # 6711 GB/s
                bk._row("kl[k3+]", 4096, 8192, 4.0e-4, 1e-3, 7 * 4096 * 8192 * 4),
                bk._row("whiten", 4096, 8192, 2.0e-4, 1e-3, 3 * 4096 * 8192 * 4)]
    finally:
        bk.PEAK_GBS = old
    lines = gs.bandwidth_lines("torch 2.x header\n" + "\n".join(rows), "bf16 ")
    assert lines[0].startswith("bandwidth bf16 gae 4096x8192: 6711 GB/s = 140% of 4800")
    assert lines[0].endswith("(meets the 50% goal)")
    assert "kl[k3+] 4096x8192: 2349 GB/s = 49% of 4800 GB/s (BELOW the 50% goal)" in lines[1]
    assert lines[2].endswith("(no goal)") and len(lines) == 3


def test_pytest_line():
    text = "....\n==== 61 passed, 2 skipped in 41.20s ====\n"
    assert gs.pytest_line(text) == "61 passed, 2 skipped in 41.20s"
    assert gs.pytest_line("collected 0 items\n") is None


GVISOR = """========= COMPUTE-SANITIZER
========= Error: Device not supported. Please refer to the "Supported Devices" section
========= Program hit cudaErrorUnknown (error 999) due to "unknown error" on CUDA API call
"""


def test_probe_verdict_tells_an_unusable_sanitizer():
    assert gs.probe_verdict(0, "probe ok 16773120.0\n========= ERROR SUMMARY: 0 errors") == \
        ("usable", "")
    state, why = gs.probe_verdict(1, GVISOR)
    assert state == "unavailable" and why.startswith("Error: Device not supported")
    # slow is not unavailable: no message of the tool, no proof
    state, why = gs.probe_verdict(124, "")
    assert state == "slow" and why.startswith("the sanitized probe did not finish")
    # the same words from the program, not from the tool, prove nothing about the tool either
    assert gs.probe_verdict(1, "RuntimeError: CUDA error: device not supported\n")[0] == "failed"


def test_tool_verdicts():
    assert gs.tool_verdict("memcheck", 0, "========= ERROR SUMMARY: 0 errors") == \
        (gp.OK, "memcheck: ERROR SUMMARY: 0 errors")
    status, detail = gs.tool_verdict("racecheck", 9, "========= RACECHECK SUMMARY: 2 hazards "
                                     "displayed (2 errors, 0 warnings)\n========= ERROR SUMMARY:"
                                     " 2 errors")
    assert status == gp.FAILED and "KERNEL FAULT" in detail and "2 hazards" in detail
    assert gs.tool_verdict("initcheck", 1, "MISMATCH: gae") == (gp.FAILED, "initcheck: MISMATCH: gae")
    assert gs.tool_verdict("synccheck", 124, "")[0] == gp.TIMEOUT


def _fake_tools(tmp_path, sanitizer_body, python_body):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("compute-sanitizer", sanitizer_body), ("fakepython", python_body)):
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    return bin_dir


def _sanitize(tmp_path, monkeypatch, sanitizer_body, python_body):
    bin_dir = _fake_tools(tmp_path, sanitizer_body, python_body)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    log = tmp_path / "sanitize.log"
    ctx = gp.Context("sanitize", log, time.monotonic() + 30, dict(os.environ),
                     str(bin_dir / "fakepython"))
    return gs.stage_sanitize(ctx)


def test_sanitize_unavailable_on_a_runtime_that_refuses_the_device(tmp_path, monkeypatch):
    res = _sanitize(tmp_path, monkeypatch, f"cat <<'EOF'\n{GVISOR}EOF\nexit 1\n",
                    "echo probe ok; exit 0\n")
    assert res.status == gp.UNAVAILABLE
    assert "sanitizer unavailable on this runtime" in res.detail
    assert "Device not supported" in res.detail


def test_sanitize_broken_gpu_is_a_failure_not_unavailable(tmp_path, monkeypatch):
    res = _sanitize(tmp_path, monkeypatch, "exit 1\n", "exit 1\n")
    assert res.status == gp.FAILED and "without the sanitizer too" in res.detail


def test_sanitize_reports_a_kernel_fault_per_tool(tmp_path, monkeypatch):
    sanitizer = """case "$*" in
  *"-c "*) echo "probe ok"; echo "========= ERROR SUMMARY: 0 errors"; exit 0;;
  *racecheck*) echo "========= ERROR SUMMARY: 1 error"; exit 9;;
  *) echo "gae: ok"; echo "========= ERROR SUMMARY: 0 errors"; exit 0;;
esac
"""
    res = _sanitize(tmp_path, monkeypatch, sanitizer, "exit 0\n")
    assert res.status == gp.FAILED
    assert res.lines[0].startswith("sanitize probe: ")
    said = [re.sub(r" \(\d+ s of a \d+ s share\)$", "", ln) for ln in res.lines[1:]]
    assert said == ["sanitize memcheck: ERROR SUMMARY: 0 errors",
                    "sanitize racecheck: KERNEL FAULT reported: ERROR SUMMARY: 1 error",
                    "sanitize synccheck: ERROR SUMMARY: 0 errors",
                    "sanitize initcheck: ERROR SUMMARY: 0 errors"]
    logs = sorted(p.name for p in tmp_path.glob("sanitize_*.log"))
    assert logs == ["sanitize_initcheck.log", "sanitize_memcheck.log", "sanitize_probe.log",
                    "sanitize_racecheck.log", "sanitize_synccheck.log"]


def test_stage_commands_do_not_see_out(monkeypatch):
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    env = gs.base_env()
    assert "OUT" not in env
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [gs.SITE, str(ROOT)]


def test_tools_that_fit_give_each_started_tool_1_5_probes():
    assert gs.tools_that_fit(90, 20, 4) == 3  # 30 s each >= 1.5 x 20 s
    assert gs.tools_that_fit(65, 20, 3) == 2
    assert gs.tools_that_fit(29, 20, 4) == 0  # not even one share of 30 s
    assert gs.tools_that_fit(1000, 1, 4) == 4  # never more than the tools left
    assert gs.tools_that_fit(5, 0, 2) == 2  # a probe that took no time
    assert list(gs.SANITIZER_TOOLS)[:2] == ["memcheck", "racecheck"]  # the valuable ones first


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _timed_sanitize(tmp_path, monkeypatch, took):
    """stage_sanitize on a fake clock: ``took[key]`` seconds for the probe and each tool (each
    exits 0, or is killed at its limit); the commands' (key, limit) in order."""
    clock, calls = FakeClock(), []

    def fake_run(cmd, log, timeout_s, env):
        key = "probe" if "-c" in cmd else cmd[cmd.index("--tool") + 1]
        calls.append((key, round(timeout_s, 1)))
        clock.now += min(took[key], timeout_s)
        with open(log, "a") as f:
            f.write("probe ok\n" if key == "probe" else "========= ERROR SUMMARY: 0 errors\n")
        return 0 if took[key] <= timeout_s else 124

    monkeypatch.setattr(gp, "run_command", fake_run)
    monkeypatch.setattr(gs, "find_sanitizer", lambda: "/fake/compute-sanitizer")
    ctx = gp.Context("sanitize", tmp_path / "sanitize.log", clock() + 110, {}, "python3", clock)
    return gs.stage_sanitize(ctx), calls


def test_sanitize_starts_a_tool_only_with_a_share_of_1_5_probes(tmp_path, monkeypatch):
    # 110 s cap, probe 20 s: 90 s left for 3 tools of 30 s; memcheck takes 25, 65 s left: 2 of
    # 32.5; racecheck 30, 35 s left: 1; synccheck 10, 25 s left < 30: initcheck NOT RUN
    took = {"probe": 20, "memcheck": 25, "racecheck": 30, "synccheck": 10, "initcheck": 10}
    res, calls = _timed_sanitize(tmp_path, monkeypatch, took)
    assert calls == [("probe", 40), ("memcheck", 30.0), ("racecheck", 32.5), ("synccheck", 35.0)]
    assert res.status == gp.NOT_RUN  # not run: exit 3 unless --allow-partial, never FAILED
    assert res.lines == ["sanitize probe: 20.0 s (a trivial torch program under memcheck)",
                         "sanitize memcheck: ERROR SUMMARY: 0 errors (25 s of a 30 s share)",
                         "sanitize racecheck: ERROR SUMMARY: 0 errors (30 s of a 32 s share)",
                         "sanitize synccheck: ERROR SUMMARY: 0 errors (10 s of a 35 s share)",
                         "sanitize initcheck: NOT RUN - 25 s left, under 1.5 x the probe's "
                         "20.0 s per tool"]
    assert res.detail == res.lines[-1]
    assert gc.exit_status([res], allow_partial=False) == 3
    assert gc.exit_status([res], allow_partial=True) == 0


def test_sanitize_with_a_slow_probe_runs_memcheck_alone(tmp_path, monkeypatch):
    took = {"probe": 40, "memcheck": 60, "racecheck": 1, "synccheck": 1, "initcheck": 1}
    res, calls = _timed_sanitize(tmp_path, monkeypatch, took)
    assert calls == [("probe", 40), ("memcheck", 70.0)]  # 70 s < 2 x 60: one tool, all of it
    assert res.status == gp.NOT_RUN
    assert res.lines[-1].startswith("sanitize racecheck, synccheck, initcheck: NOT RUN - 10 s")


def test_sanitize_a_tool_past_its_share_is_a_timeout(tmp_path, monkeypatch):
    took = {"probe": 10, "memcheck": 99, "racecheck": 1, "synccheck": 1, "initcheck": 1}
    res, calls = _timed_sanitize(tmp_path, monkeypatch, took)
    assert calls[1] == ("memcheck", 25.0) and res.status == gp.TIMEOUT
    assert "memcheck: TIMEOUT: did not finish in its 25 s share" in res.detail
