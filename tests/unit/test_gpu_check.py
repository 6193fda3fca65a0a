"""scripts/gpu_check.py without a GPU: the dry-run plan against the budget, the stage, time,
dependency and exit-status rules (fake stage bodies on a fake clock: nothing here depends on how
fast this machine runs), the files left in $OUT, and the modules' import graph. The stage bodies
and their readers: tests/unit/test_gpu_check_stages.py."""

import ast
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
import gpu_plan as gp  # noqa: E402


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
    assert caps["env"] >= 30, caps  # pip install --no-compile, then cold torch/megatron imports
    # build: setup.py builds _C (kl_cpu.cpp, 19 s measured on CPU) before _C_cuda, whose .cu
    # files compile side by side (gae_cuda.cu 71 s, kl_cuda.cu 68 s): twice that is 180 s
    measured = gp.BUILD_MEASURED_S
    assert caps["build"] >= 2 * (measured["kl_cpu.cpp"] + max(measured["gae_cuda.cu"],
                                                              measured["kl_cuda.cu"])), caps
    assert critical <= 410, caps  # the critical path: env + the kernels' verdict
    assert sum(caps.values()) <= 580, caps  # a full run: inside the device's 600 s per command
    assert f"critical path (env + build + tests + sanitize + bench as selected): {critical} s" \
        in proc.stdout
    assert f"total: {sum(caps.values())} s of caps within the 580 s budget" in proc.stdout
    for name in ("models", "engine", "ppo"):  # the stages that need the carried wheels say so
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(name + " "))
        assert line.endswith("[needs megatron.core, omegaconf]"), line


def test_dry_run_of_a_subset_and_a_budget_too_small():
    proc = _dry_run("--steps", "ppo,build", "--budget", "250")
    assert proc.returncode == 0, proc.stderr
    names = [ln.split()[0] for ln in proc.stdout.splitlines()[1:4]]
    assert names == ["env", "build", "ppo"]  # run order, not the order asked
    assert "EXCEEDS the 250 s budget: ppo would be NOT RUN" in proc.stdout
    bad = _dry_run("--steps", "build,sanitizer")
    assert bad.returncode == 2 and "unknown stage(s) ['sanitizer']" in bad.stderr


def test_parse_steps_and_late_stages():
    assert [s.name for s in gc.parse_steps(None)] == list(gp.STAGE_NAMES)
    assert [s.name for s in gc.parse_steps("bench, tests")] == ["tests", "bench"]
    with pytest.raises(ValueError, match="allowed: build,tests"):
        gc.parse_steps("tests,gpu")
    rows = [gp.Stage(n, c, False, False, "") for n, c in (("a", 50), ("b", 60), ("c", 40))]
    assert gc.late_stages(rows, 100) == ["b"]  # c still fits after b is skipped
    assert gc.late_stages(rows, 150) == []


def _stage(name, cap, needs_build=False):
    return gp.Stage(name, cap, True, needs_build, f"fake {name}")


class FakeClock:
    """Seconds that pass only when a fake stage body says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _fake(clock, seconds, status=gp.OK, lines=(), calls=None):
    """A stage body that takes ``seconds`` on ``clock`` and returns ``status``; no subprocess."""
    def runner(ctx):
        if calls is not None:
            calls.append(ctx.name)
        clock.now += seconds
        return gp.Result(ctx.name, status, lines=list(lines),
                         detail="torch sees no CUDA device" if status == gp.FAILED else "")
    return runner


def _run(tmp_path, stages, runners, budget, allow_partial=False, setup=None, clock=time.monotonic):
    out = tmp_path / "out"
    echoed = []
    code = gc.run_check(stages, runners, budget_s=budget, out_dir=out, log_dir=tmp_path / "logs",
                        env=dict(os.environ), python=sys.executable,
                        allow_partial=allow_partial, setup=setup, echo=echoed.append,
                        clock=clock)
    return code, (out / gc.SUMMARY_FILE).read_text(), out


def _py(code):
    def runner(ctx):
        rc = ctx.sh([sys.executable, "-c", code])
        return gp.Result(ctx.name, gp.OK if rc == 0 else gp.TIMEOUT if rc == 124 else gp.FAILED,
                         lines=gp.summary_lines_of(ctx.text()))
    return runner


def _alive_with(text: str) -> list[int]:
    """The live (not zombie) processes whose command line contains ``text``."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if text.encode() in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


def test_a_stage_over_its_cap_is_killed_with_its_children(tmp_path):
    flag = tmp_path / "late"
    child = f"import time; time.sleep(2.5); open({str(flag)!r}, 'w')"
    body = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}]); "
            "import time; time.sleep(30)")
    t0 = time.monotonic()
    code, summary, _ = _run(tmp_path, [_stage("slow", 1)], {"slow": _py(body)}, budget=20)
    assert time.monotonic() - t0 < 10  # killed at the 1 s cap, not after the 30 s sleep
    assert code == 1 and "slow: TIMEOUT" in summary and "verdict: FAIL" in summary
    deadline = time.monotonic() + 60  # not a sleep: a grandchild that survived the kill lives
    while _alive_with(str(flag)) and time.monotonic() < deadline:  # on to write the flag
        time.sleep(0.1)
    assert not flag.exists()  # the grandchild went with the process group


def test_a_stage_that_does_not_fit_is_not_run_and_fails_the_exit_status(tmp_path):
    clock = FakeClock()
    stages = [_stage("first", 20), _stage("second", 30), _stage("third", 5)]
    runners = {"first": _fake(clock, 15), "second": _fake(clock, 1), "third": _fake(clock, 2)}
    code, summary, _ = _run(tmp_path, stages, runners, budget=40, clock=clock)  # 25 s left
    assert code == 3
    assert "second: NOT RUN - skipped for time: 25 s of the budget left, cap 30 s" in summary
    assert "first: ok in 15 s (cap 20 s)" in summary  # measured, next to the cap
    assert "third: ok in 2 s (cap 5 s)" in summary  # a later stage that fits runs
    assert "times (measured s / cap s, - = not started): first 15/20, second -/30, third 2/5" \
        in summary
    assert "verdict: INCOMPLETE" in summary and "(exit 3)" in summary
    clock = FakeClock()
    runners = {"first": _fake(clock, 15), "second": _fake(clock, 1), "third": _fake(clock, 2)}
    code, summary, _ = _run(tmp_path, stages, runners, budget=40, allow_partial=True,
                            clock=clock)
    assert code == 0 and "INCOMPLETE (allowed: --allow-partial)" in summary
    clock = FakeClock()  # the rule is "the whole cap fits": 30 s left lets a 30 s cap start
    runners = {"first": _fake(clock, 10), "second": _fake(clock, 1), "third": _fake(clock, 2)}
    code, summary, _ = _run(tmp_path, stages[:2], runners, budget=40, clock=clock)
    assert code == 0 and "second: ok in 1 s (cap 30 s)" in summary


def test_build_failure_blocks_its_dependents_and_stage_errors_stay_in_their_stage(tmp_path):
    def broken(ctx):
        raise RuntimeError("stage body bug")

    clock, calls = FakeClock(), []
    stages = [_stage("build", 5), _stage("tests", 5, needs_build=True), _stage("other", 5),
              _stage("last", 5)]
    runners = {"build": _fake(clock, 1, gp.FAILED), "tests": _fake(clock, 1, calls=calls),
               "other": broken, "last": _fake(clock, 1, lines=["last line"])}
    code, summary, _ = _run(tmp_path, stages, runners, budget=60, clock=clock)
    assert code == 1 and calls == []
    assert "build: FAILED" in summary and "tests: NOT RUN - build did not pass" in summary
    assert "other: FAILED" in summary and "RuntimeError: stage body bug" in summary
    assert "last: ok" in summary and "\nlast line\n" in summary


def test_a_failed_env_blocks_every_later_stage(tmp_path):
    clock, calls = FakeClock(), []
    env = gp.Stage("env", 30, True, False, "fake env")
    stages = [_stage("build", 5), _stage("tests", 5, needs_build=True), _stage("ppo", 5)]
    runners = {"env": _fake(clock, 3, gp.FAILED)}
    runners.update({s.name: _fake(clock, 1, calls=calls) for s in stages})
    code, summary, _ = _run(tmp_path, stages, runners, budget=60, setup=env, clock=clock)
    assert code == 1 and calls == []  # no GPU stage burns device time after a broken env
    assert "env: FAILED in 3 s (cap 30 s) - torch sees no CUDA device" in summary
    for name in ("build", "tests", "ppo"):
        assert (f"{name}: NOT RUN - env did not pass (FAILED: torch sees no CUDA device)"
                in summary)
    runners["env"] = _fake(clock, 3, gp.TIMEOUT)
    code, summary, _ = _run(tmp_path, stages, runners, budget=60, setup=env, clock=clock)
    assert code == 1 and calls == [] and "ppo: NOT RUN - env did not pass (TIMEOUT)" in summary
    runners["env"] = _fake(clock, 3)
    code, summary, _ = _run(tmp_path, stages, runners, budget=60, setup=env, clock=clock)
    assert code == 0 and calls == ["build", "tests", "ppo"]


def test_out_holds_at_most_three_files_rewritten_after_each_stage(tmp_path):
    seen = {}

    def peek(ctx):  # what $OUT holds while the second stage runs
        out = tmp_path / "out"
        seen["files"] = sorted(p.name for p in out.iterdir())
        seen["summary"] = (out / gc.SUMMARY_FILE).read_text()
        for i in range(6):  # a stage with many logs
            ctx.log.with_name(f"{ctx.name}_{i}.log").write_text(f"log {i}\n")
        return gp.Result(ctx.name, gp.OK)

    stages = [_stage("one", 30), _stage("two", 30), _stage("three", 30)]
    runners = {"one": _py("print('hello')"), "two": peek, "three": _py("pass")}
    code, summary, out = _run(tmp_path, stages, runners, budget=120)
    assert code == 0 and "verdict: PASS: 3 of 3 stages ran (exit 0)" in summary
    assert seen["files"] == [gc.ARCHIVE_FILE, gc.SUMMARY_FILE]
    assert "one: ok" in seen["summary"] and "verdict: still running" in seen["summary"]
    files = sorted(p.name for p in out.iterdir())
    assert files == [gc.ARCHIVE_FILE, gc.SUMMARY_FILE] and len(files) <= 3
    with tarfile.open(out / gc.ARCHIVE_FILE) as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"one.log", "two_5.log", "three.log", gc.SUMMARY_FILE} <= names


def test_exit_status_rules():
    r = gp.Result
    assert gc.exit_status([r("a", gp.OK), r("b", gp.OK)], False) == 0
    assert gc.exit_status([r("a", gp.OK), r("b", gp.UNAVAILABLE)], False) == 3
    assert gc.exit_status([r("a", gp.OK), r("b", gp.UNAVAILABLE)], True) == 0
    assert gc.exit_status([r("a", gp.NOT_RUN), r("b", gp.TIMEOUT)], True) == 1


def _imports(path):
    tree = ast.parse(path.read_text())
    found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    found |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return found


def test_gpu_modules_import_without_a_cycle():
    mine = {"gpu_check", "gpu_stages", "gpu_plan"}
    graph = {m: _imports(ROOT / "scripts" / f"{m}.py") & mine for m in mine}
    assert graph == {"gpu_plan": set(), "gpu_stages": {"gpu_plan"},
                     "gpu_check": {"gpu_plan", "gpu_stages"}}
    for m in mine:
        assert "sys.modules" not in (ROOT / "scripts" / f"{m}.py").read_text(), m
    # run as a script, gpu_check shares one gpu_plan (one Result class) with gpu_stages
    code = ("import runpy, sys; sys.path.insert(0, 'scripts'); "
            "g = runpy.run_path('scripts/gpu_check.py', run_name='not_main'); "
            "import gpu_plan, gpu_stages; "
            "assert g['Result'] is gpu_plan.Result is gpu_stages.Result; "
            "assert 'gpu_check' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
