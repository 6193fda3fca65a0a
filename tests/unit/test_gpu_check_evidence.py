"""No stage of scripts/gpu_check.py reads ok without evidence (issue 37 item 6), without a GPU:
- the tests stage run for real on this CPU machine, where every CUDA test skips: NOT RUN with
  the skip reason (it read "ok" before); pytest's counts read right;
- bench: a run that exits 0 but prints no bandwidth row fails;
- sanitize: a probe that is merely slow is NOT RUN, one that fails without the tool's own
  message FAILED, UNAVAILABLE only on the tool's message (fake compute-sanitizer on PATH);
- build: an extension load error (hybridrl.kernels.ops raises ExtensionLoadError) fails the
  stage with the error as its detail;
- env: wheels that did not install block only the stages that need them; the kernel stages'
  entry points import with megatron, omegaconf and transformer-engine absent (the device
  image has none of them unless the wheels install).
"""

import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check as gc  # noqa: E402
import gpu_plan as gp  # noqa: E402
import gpu_stages as gs  # noqa: E402


def _ctx(tmp_path, name, python=sys.executable, cap=120):
    env = gs.base_env()
    return gp.Context(name, tmp_path / f"{name}.log", time.monotonic() + cap, env, python)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU case")
def test_tests_stage_with_every_test_skipped_is_not_run(tmp_path):
    res = gs.stage_tests(_ctx(tmp_path, "tests"))  # tests/gpu/test_kernels_cuda.py, for real
    assert res.status == gp.NOT_RUN, (res, (tmp_path / "tests.log").read_text()[-2000:])
    assert res.detail.startswith("no test ran (")
    assert "skipped: needs a CUDA device" in res.detail
    assert gc.exit_status([res], allow_partial=False) == 3  # INCOMPLETE, never PASS


def test_pytest_verdicts():
    assert gs.pytest_verdict(0, "== 61 passed, 2 skipped in 41.2s ==") == (gp.OK, "")
    assert gs.pytest_verdict(1, "== 1 failed, 60 passed in 41.2s ==") == (gp.FAILED, "")
    assert gs.pytest_verdict(5, "== no tests ran in 0.01s ==") == \
        (gp.NOT_RUN, "no test ran (none collected)")
    assert gs.pytest_verdict(1, "== 3 errors in 1.0s ==")[0] == gp.FAILED  # collection errors
    assert gs.pytest_counts("1 failed, 2 passed, 3 skipped, 2 errors in 5s") == \
        {"passed": 2, "failed": 1, "error": 2, "skipped": 3}


def _fake_python(tmp_path, body):
    path = tmp_path / "fakepython"
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return str(path)


def test_bench_without_a_bandwidth_row_fails(tmp_path):
    python = _fake_python(tmp_path, "echo 'torch 2.11 on cuda: nothing measured'; exit 0\n")
    res = gs.stage_bench(_ctx(tmp_path, "bench", python))
    assert res.status == gp.FAILED and res.lines == []
    assert res.detail == "fp32 run printed no bandwidth row; bf16 run printed no bandwidth row"
    row = "gae 4096x8192  0.10 ms  bytes 671 MB  6711 GB/s = 140% of 4800 GB/s\n"
    python = _fake_python(tmp_path, f"echo '{row}'; exit 0\n")
    res = gs.stage_bench(_ctx(tmp_path, "bench2", python))
    assert res.status == gp.OK and len(res.lines) == 2


def _sanitize(tmp_path, monkeypatch, sanitizer, python="exit 0\n"):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "compute-sanitizer"
    tool.write_text("#!/usr/bin/env bash\n" + sanitizer)
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return gs.stage_sanitize(_ctx(tmp_path, "sanitize", _fake_python(tmp_path, python), cap=30))


def test_sanitize_unavailable_needs_the_tools_own_message(tmp_path, monkeypatch):
    slow = _sanitize(tmp_path, monkeypatch, "exit 124\n")  # what a probe past PROBE_S returns
    assert slow.status == gp.NOT_RUN and "slow is not unavailable" in slow.detail
    silent = _sanitize(tmp_path, monkeypatch,
                       "echo 'RuntimeError: device not supported'; exit 1\n")  # the program's
    assert silent.status == gp.FAILED
    assert "without a message of the tool" in silent.detail
    said = _sanitize(tmp_path, monkeypatch,
                     "echo '========= Error: Device not supported. Please refer'; exit 1\n")
    assert said.status == gp.UNAVAILABLE
    assert "the tool says: Error: Device not supported" in said.detail


def test_build_check_reports_the_extension_load_error(monkeypatch):
    from hybridrl.kernels import ops

    def broken(op, device_type):
        raise ops.ExtensionLoadError("hybridrl._C_cuda: undefined symbol: _ZN3c10 (the "
                                     "extension was built for another torch)\nsecond line")

    monkeypatch.setattr(ops, "compiled_available", broken)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as code:
        exec(gs.BUILD_CHECK, {})
    assert code.value.code == 1
    lines = gp.summary_lines_of(out.getvalue())
    assert lines == ["build: extension load FAILED: ExtensionLoadError: hybridrl._C_cuda: "
                     "undefined symbol: _ZN3c10 (the extension was built for another torch)"]


def test_missing_wheels_block_only_the_stages_that_need_them(tmp_path):
    env = gp.Result("env", gp.OK, missing=("megatron.core",))
    assert gs.missing_modules("env: H200, megatron.core MISSING (ImportError), omegaconf ok") \
        == ("megatron.core",)
    by_name = {s.name: s for s in gp.STAGES}
    for name in ("build", "tests", "sanitize", "bench"):
        assert gc.blocked_by(by_name[name], {"env": env}) == ""
    for name in ("models", "engine", "ppo"):
        assert gc.blocked_by(by_name[name], {"env": env}) == \
            "needs megatron.core, which did not import in env (the carried wheels, .whl/)"


BLOCK = """
import sys, runpy
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("megatron", "omegaconf", "transformer_engine"):
            raise ImportError("absent on the device image: " + name)
sys.meta_path.insert(0, Block())
sys.path.insert(0, ".")
from hybridrl.kernels import ops                                       # build (BUILD_CHECK)
import benchmarks.kernels                                              # bench
runpy.run_path("scripts/kernel_sanitizer_cases.py", run_name="cases")  # sanitize
import pytest                                                          # tests
code = pytest.main(["-q", "--collect-only", "-p", "no:cacheprovider",
                    "tests/gpu/test_kernels_cuda.py"])
raise SystemExit(code)
"""


def test_kernel_stages_import_without_the_wheels():
    proc = subprocess.run([sys.executable, "-c", BLOCK], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "tests collected" in proc.stdout
