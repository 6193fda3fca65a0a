"""scripts/gpu_check.py without a GPU: the dry-run plan against the budget, the stage, time and
exit-status rules, the files left in $OUT, and the readers of the stages' output (bandwidth rows,
pytest lines, the compute-sanitizer probe and tools, with a fake compute-sanitizer on PATH)."""

import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check as gc  # noqa: E402
import gpu_stages as gs  # noqa: E402


def _dry_run(*args):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("GPU_CHECK_BUDGET_S", None)
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_dry_run_prints_every_stage_with_caps_within_the_budget():
    proc = _dry_run()
    assert proc.returncode == 0, proc.stderr
    caps, critical = {}, 0
    for line in proc.stdout.splitlines():
        m = re.match(r"^(\w+)\s+(\d+)\s+(critical|rest)\s", line)
        if m:
            caps[m[1]] = int(m[2])
            critical += int(m[2]) if m[3] == "critical" else 0
    assert list(caps) == ["env", "build", "tests", "sanitize", "bench", "models", "engine", "ppo"]
    assert critical <= 360, caps  # the critical path: <= 6 minutes on the H200
    assert sum(caps.values()) <= 540, caps  # a full run: <= 9 minutes
    assert f"critical path (env + build + tests + sanitize + bench as selected): {critical} s" \
        in proc.stdout
    assert f"total: {sum(caps.values())} s of caps within the 540 s budget" in proc.stdout


def test_dry_run_of_a_subset_and_a_budget_too_small():
    proc = _dry_run("--steps", "ppo,build", "--budget", "150")
    assert proc.returncode == 0, proc.stderr
    names = [ln.split()[0] for ln in proc.stdout.splitlines()[1:4]]
    assert names == ["env", "build", "ppo"]  # run order, not the order asked
    assert "EXCEEDS the 150 s budget: ppo would be NOT RUN" in proc.stdout
    bad = _dry_run("--steps", "build,sanitizer")
    assert bad.returncode == 2 and "unknown stage(s) ['sanitizer']" in bad.stderr


def test_parse_steps_and_late_stages():
    assert [s.name for s in gc.parse_steps(None)] == list(gc.STAGE_NAMES)
    assert [s.name for s in gc.parse_steps("bench, tests")] == ["tests", "bench"]
    with pytest.raises(ValueError, match="allowed: build,tests"):
        gc.parse_steps("tests,gpu")
    rows = [gc.Stage(n, c, False, False, "") for n, c in (("a", 50), ("b", 60), ("c", 40))]
    assert gc.late_stages(rows, 100) == ["b"]  # c still fits after b is skipped
    assert gc.late_stages(rows, 150) == []


def _stage(name, cap, needs_build=False):
    return gc.Stage(name, cap, True, needs_build, f"fake {name}")


def _run(tmp_path, stages, runners, budget, allow_partial=False):
    out = tmp_path / "out"
    echoed = []
    code = gc.run_check(stages, runners, budget_s=budget, out_dir=out, log_dir=tmp_path / "logs",
                        env=dict(os.environ), python=sys.executable,
                        allow_partial=allow_partial, setup=None, echo=echoed.append)
    return code, (out / gc.SUMMARY_FILE).read_text(), out


def _py(code):
    def runner(ctx):
        rc = ctx.sh([sys.executable, "-c", code])
        return gc.Result(ctx.name, gc.OK if rc == 0 else gc.TIMEOUT if rc == 124 else gc.FAILED,
                         lines=gc.summary_lines_of(ctx.text()))
    return runner


def test_a_stage_over_its_cap_is_killed_with_its_children(tmp_path):
    flag = tmp_path / "late"
    child = f"import time; time.sleep(2.5); open({str(flag)!r}, 'w')"
    body = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}]); "
            "import time; time.sleep(30)")
    t0 = time.monotonic()
    code, summary, _ = _run(tmp_path, [_stage("slow", 1)], {"slow": _py(body)}, budget=20)
    assert time.monotonic() - t0 < 10
    assert code == 1 and "slow: TIMEOUT" in summary and "verdict: FAIL" in summary
    time.sleep(3)
    assert not flag.exists()  # the grandchild went with the process group


def test_a_stage_that_does_not_fit_is_not_run_and_fails_the_exit_status(tmp_path):
    stages = [_stage("first", 2), _stage("second", 3), _stage("third", 1)]
    runners = {"first": _py("import time; time.sleep(1.5)"), "second": _py("pass"),
               "third": _py("pass")}
    code, summary, _ = _run(tmp_path, stages, runners, budget=4)  # 2.5 s left for a 3 s cap
    assert code == 3
    assert "second: NOT RUN - skipped for time" in summary
    assert "first: ok" in summary and "third: ok" in summary  # a later stage that fits runs
    assert "verdict: INCOMPLETE" in summary and "(exit 3)" in summary
    code, summary, _ = _run(tmp_path, stages, runners, budget=4, allow_partial=True)
    assert code == 0 and "INCOMPLETE (allowed: --allow-partial)" in summary


def test_build_failure_blocks_its_dependents_and_stage_errors_stay_in_their_stage(tmp_path):
    def broken(ctx):
        raise RuntimeError("stage body bug")

    stages = [_stage("build", 5), _stage("tests", 5, needs_build=True), _stage("other", 5),
              _stage("last", 5)]
    runners = {"build": _py("raise SystemExit(3)"), "tests": _py("pass"), "other": broken,
               "last": _py("print('SUMMARY: last line')")}
    code, summary, _ = _run(tmp_path, stages, runners, budget=60)
    assert code == 1
    assert "build: FAILED" in summary and "tests: NOT RUN - build did not pass" in summary
    assert "other: FAILED" in summary and "RuntimeError: stage body bug" in summary
    assert "last: ok" in summary and "\nlast line\n" in summary


def test_out_holds_at_most_three_files_rewritten_after_each_stage(tmp_path):
    seen = {}

    def peek(ctx):  # what $OUT holds while the second stage runs
        out = tmp_path / "out"
        seen["files"] = sorted(p.name for p in out.iterdir())
        seen["summary"] = (out / gc.SUMMARY_FILE).read_text()
        for i in range(6):  # a stage with many logs
            ctx.log.with_name(f"{ctx.name}_{i}.log").write_text(f"log {i}\n")
        return gc.Result(ctx.name, gc.OK)

    stages = [_stage("one", 5), _stage("two", 5), _stage("three", 5)]
    runners = {"one": _py("print('hello')"), "two": peek, "three": _py("pass")}
    code, summary, out = _run(tmp_path, stages, runners, budget=60)
    assert code == 0 and "verdict: PASS: 3 of 3 stages ran (exit 0)" in summary
    assert seen["files"] == [gc.ARCHIVE_FILE, gc.SUMMARY_FILE]
    assert "one: ok" in seen["summary"] and "verdict: still running" in seen["summary"]
    files = sorted(p.name for p in out.iterdir())
    assert files == [gc.ARCHIVE_FILE, gc.SUMMARY_FILE] and len(files) <= 3
    with tarfile.open(out / gc.ARCHIVE_FILE) as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"one.log", "two_5.log", "three.log", gc.SUMMARY_FILE} <= names


def test_exit_status_rules():
    r = gc.Result
    assert gc.exit_status([r("a", gc.OK), r("b", gc.OK)], False) == 0
    assert gc.exit_status([r("a", gc.OK), r("b", gc.UNAVAILABLE)], False) == 3
    assert gc.exit_status([r("a", gc.OK), r("b", gc.UNAVAILABLE)], True) == 0
    assert gc.exit_status([r("a", gc.NOT_RUN), r("b", gc.TIMEOUT)], True) == 1


# ---- readers of the stages' output ---------------------------------------------------------


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
        (True, "")
    ok, why = gs.probe_verdict(1, GVISOR)
    assert not ok and why.startswith("Error: Device not supported")
    assert gs.probe_verdict(124, "")[1].startswith("the sanitized probe did not finish")


def test_tool_verdicts():
    assert gs.tool_verdict("memcheck", 0, "========= ERROR SUMMARY: 0 errors") == \
        (gc.OK, "memcheck: ERROR SUMMARY: 0 errors")
    status, detail = gs.tool_verdict("racecheck", 9, "========= RACECHECK SUMMARY: 2 hazards "
                                     "displayed (2 errors, 0 warnings)\n========= ERROR SUMMARY:"
                                     " 2 errors")
    assert status == gc.FAILED and "KERNEL FAULT" in detail and "2 hazards" in detail
    assert gs.tool_verdict("initcheck", 1, "MISMATCH: gae") == (gc.FAILED, "initcheck: MISMATCH: gae")
    assert gs.tool_verdict("synccheck", 124, "")[0] == gc.TIMEOUT


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
    ctx = gc.Context("sanitize", log, time.monotonic() + 30, dict(os.environ),
                     str(bin_dir / "fakepython"))
    return gs.stage_sanitize(ctx)


def test_sanitize_unavailable_on_a_runtime_that_refuses_the_device(tmp_path, monkeypatch):
    res = _sanitize(tmp_path, monkeypatch, f"cat <<'EOF'\n{GVISOR}EOF\nexit 1\n",
                    "echo probe ok; exit 0\n")
    assert res.status == gc.UNAVAILABLE
    assert "sanitizer unavailable on this runtime" in res.detail
    assert "Device not supported" in res.detail


def test_sanitize_broken_gpu_is_a_failure_not_unavailable(tmp_path, monkeypatch):
    res = _sanitize(tmp_path, monkeypatch, "exit 1\n", "exit 1\n")
    assert res.status == gc.FAILED and "without the sanitizer too" in res.detail


def test_sanitize_reports_a_kernel_fault_per_tool(tmp_path, monkeypatch):
    sanitizer = """case "$*" in
  *"-c "*) echo "probe ok"; echo "========= ERROR SUMMARY: 0 errors"; exit 0;;
  *racecheck*) echo "========= ERROR SUMMARY: 1 error"; exit 9;;
  *) echo "gae: ok"; echo "========= ERROR SUMMARY: 0 errors"; exit 0;;
esac
"""
    res = _sanitize(tmp_path, monkeypatch, sanitizer, "exit 0\n")
    assert res.status == gc.FAILED
    assert res.lines == ["sanitize memcheck: ERROR SUMMARY: 0 errors",
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
