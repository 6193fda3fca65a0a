"""What each stage of ``scripts/gpu_check.py`` runs on the GPU machine, and how its output reads.

Contract:
- ``RUNNERS[name](ctx) -> Result`` for ``env`` and every stage of ``gpu_plan.STAGES``; each body
  runs its commands through ``ctx.sh`` (output into the stage's log, bounded by the stage's cap)
  and returns the verdict with the result lines it read from that output.
- ``base_env()``: the environment of every command: ``PYTHONPATH`` = ``/tmp/site`` (where ``env``
  installs the carried wheels, ``.whl/``) + the repository; ``TORCH_CUDA_ARCH_LIST=9.0`` and
  ``MAX_JOBS`` = the CPU count unless set; unbuffered Python; no ``OUT`` (no command writes
  beside summary.txt and the archive).
- Readers (pure, tested without a GPU): ``bandwidth_lines`` (benchmarks.kernels rows against the
  50% goal), ``pytest_line`` and ``pytest_counts`` (passed / failed / errors / skipped; a stage
  in which no test ran is NOT RUN with the first skip reason, ``pytest_verdict``),
  ``missing_modules`` (env's ``MISSING`` marks), ``probe_verdict`` (can compute-sanitizer run a
  trivial torch program here: "usable"; "unavailable" only on the tool's own message, a line
  of its ``=========`` output; "slow" when it did not finish; else "failed") and
  ``tool_verdict`` (one sanitizer tool's run over scripts/kernel_sanitizer_cases.py).
- Evidence rules: env fails only without a CUDA device (a wheel that did not install is listed
  in ``Result.missing`` and blocks only the stages that need it); build fails when any op has
  no CUDA kernel or the extension does not load (``hybridrl.kernels.ops`` raises its
  ``ExtensionLoadError``; the stage's detail is that error's first line); bench fails when a
  run exits 0 but printed no bandwidth row.
- ``sanitize``: the probe is timed; every tool pays the same sanitized torch start-up, so a tool
  starts only when its equal share of the stage's time left is >= ``MIN_SHARE_X`` x the probe's
  time (``tools_that_fit``); the tools run most valuable first (``SANITIZER_TOOLS``: memcheck,
  racecheck, then synccheck, initcheck) and those that do not fit are NOT RUN (the stage counts
  as not run: exit 3 unless --allow-partial), never FAILED.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from gpu_plan import FAILED, NOT_RUN, OK, TIMEOUT, UNAVAILABLE, Context, Result, summary_lines_of

ROOT = Path(__file__).resolve().parents[1]
SITE = "/tmp/site"
# tool -> the case groups it runs (racecheck and synccheck look at shared memory and barriers:
# the KL kernel has neither), in run order, most valuable first: memcheck (out-of-bounds and
# misaligned accesses), racecheck (shared-memory hazards of the GAE and whitening blocks); the
# last ones are the first left out when the stage's time runs short
SANITIZER_TOOLS = {"memcheck": "gae,kl,whiten", "racecheck": "gae,whiten",
                   "synccheck": "gae,whiten", "initcheck": "gae,kl,whiten"}
PROBE_S = 40  # at most, for the sanitized probe: torch import + CUDA init under memcheck
MIN_SHARE_X = 1.5  # a tool starts only with a share >= this x the probe's measured time
GOAL_PCT = 50
PEAK_GBS = 4800
# A trivial torch program: under compute-sanitizer it fails only when the tool cannot use the
# device (no hybridrl kernel is loaded).
PROBE = ("import torch; x = torch.arange(4096, device='cuda', dtype=torch.float32); "
         "y = float((x * 2).sum()); torch.cuda.synchronize(); print('probe ok', y)")
# Known lines of a sanitizer that cannot use the device (seen on gVisor: "Device not supported",
# then error 999 at the first allocation).
UNAVAILABLE_MARKERS = ("device not supported", "error 999", "cuda_error_unknown",
                       "unable to", "no attachable process", "not supported on this",
                       "failed to initialize")
ENV_PY = """
import importlib, importlib.util, platform, torch
found = []
for m in ("megatron.core", "omegaconf", "transformers"):
    try:
        importlib.import_module(m)
        found.append(m + " ok")
    except Exception as err:
        found.append(f"{m} MISSING ({type(err).__name__})")
te = importlib.util.find_spec("transformer_engine") is not None
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE"
sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 0
print(f"SUMMARY: env: {gpu} ({sms} SMs), Python {platform.python_version()}, torch "
      f"{torch.__version__} (CUDA {torch.version.cuda}), {', '.join(found)}, transformer_engine "
      f"{'present' if te else 'absent'}")
raise SystemExit(0 if torch.cuda.is_available() else 1)
"""
BUILD_CHECK = """
from hybridrl.kernels import ops
try:
    have = {op: ops.compiled_available(op, "cuda") for op in ops.OP_NAMES}
except Exception as err:  # ops raises ExtensionLoadError with the import error
    line = (str(err).strip().splitlines() or [""])[0]
    print(f"SUMMARY: build: extension load FAILED: {type(err).__name__}: {line}"[:400])
    raise SystemExit(1)
print("SUMMARY: build: CUDA kernels " + ", ".join(f"{k} {'ok' if v else 'MISSING'}"
                                                 for k, v in have.items()))
raise SystemExit(0 if all(have.values()) else 1)
"""


def base_env() -> dict:
    env = dict(os.environ)
    env.pop("OUT", None)  # only gpu_check.py writes there (at most 3 files come back)
    paths = [SITE, str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _status(rc: int) -> str:
    return OK if rc == 0 else TIMEOUT if rc in (124, 137) else FAILED


# ---- readers ------------------------------------------------------------------------------------

_ROW = re.compile(r"^(?P<name>\S+)\s+(?P<B>\d+)x(?P<T>\d+)\s.*?(?P<gbs>[\d.]+) GB/s"
                  r"\s*=\s*(?P<pct>\d+)% of")


def bandwidth_lines(text: str, label: str = "") -> list[str]:
    """One line per benchmarks.kernels row with a peak fraction: GB/s, % of peak, the goal."""
    out = []
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if not m:
            continue
        name, pct = m["name"], int(m["pct"])
        if name.startswith("whiten"):
            goal = "no goal"
        else:
            goal = f"{'meets' if pct >= GOAL_PCT else 'BELOW'} the {GOAL_PCT}% goal"
        out.append(f"bandwidth {label}{name} {m['B']}x{m['T']}: {float(m['gbs']):.0f} GB/s = "
                   f"{pct}% of {PEAK_GBS} GB/s ({goal})")
    return out


_COUNT = re.compile(r"\b(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b")
_SKIP = re.compile(r"^SKIPPED \[\d+\] (?P<where>[^:]+:\d+): (?P<why>.*)$")


def pytest_counts(line: str | None) -> dict[str, int]:
    """{passed, failed, error, skipped, ...} of pytest's result line (absent kinds: 0)."""
    out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for n, kind in _COUNT.findall(line or ""):
        kind = "error" if kind.startswith("error") else kind
        out[kind] = out.get(kind, 0) + int(n)
    return out


def pytest_verdict(rc: int, text: str) -> tuple[str, str]:
    """(status, detail) of a pytest stage: NOT RUN when no test ran (all skipped, none
    collected), whatever the exit status says; else by the exit status."""
    line = pytest_line(text)
    counts = pytest_counts(line)
    ran = counts["passed"] + counts["failed"] + counts["error"] + counts.get("xpassed", 0) \
        + counts.get("xfailed", 0)
    if rc in (124, 137):
        return TIMEOUT, ""
    if ran == 0 and rc in (0, 5):
        reasons = [m["why"] for m in map(_SKIP.match, text.splitlines()) if m]
        why = f": {reasons[0]}" if reasons else ""
        return NOT_RUN, (f"no test ran ({counts['skipped']} skipped{why})" if counts["skipped"]
                         else "no test ran (none collected)")
    return _status(rc), ""


def missing_modules(text: str) -> tuple[str, ...]:
    """The modules env's ENV_PY marked ``MISSING``."""
    return tuple(re.findall(r"([\w.]+) MISSING", text))


def pytest_line(text: str) -> str | None:
    """pytest's last result line ("12 passed, 1 skipped in 3.2s"), without the === frame."""
    found = None
    for line in text.splitlines():
        if re.search(r"\b\d+ (passed|failed|error|errors|skipped)\b", line) and " in " in line:
            found = line.strip().strip("=").strip()
    return found


def probe_verdict(rc: int, text: str) -> tuple[str, str]:
    """(state, why) from the sanitized probe's exit status and output: "usable"; "unavailable"
    only when compute-sanitizer itself says so (a line of its own ``=========`` output with a
    known marker: ``why`` is that line); "slow" when it did not finish in ``PROBE_S`` (no proof
    of anything); "failed" otherwise (``why``: its first error line)."""
    if rc == 0 and "probe ok" in text:
        return "usable", ""
    if rc in (124, 137):
        return "slow", f"the sanitized probe did not finish in {PROBE_S} s"
    tool = [ln.strip().lstrip("=").strip() for ln in text.splitlines()
            if ln.startswith("=========")]
    for line in tool:
        if any(marker in line.lower() for marker in UNAVAILABLE_MARKERS):
            return "unavailable", line[:160]
    lines = [ln.strip().lstrip("=").strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return "failed", (errors[0][:160] if errors else f"probe exit status {rc}")


def tool_verdict(tool: str, rc: int, text: str, limit_s: float = 0) -> tuple[str, str]:
    """(status, detail) of one sanitizer tool over scripts/kernel_sanitizer_cases.py."""
    summary = [ln.strip().lstrip("=").strip() for ln in text.splitlines()
               if "ERROR SUMMARY" in ln or "RACECHECK SUMMARY" in ln]
    said = "; ".join(summary) or "no sanitizer summary line"
    if rc in (124, 137):
        return TIMEOUT, (f"{tool}: TIMEOUT: did not finish in its {limit_s:.0f} s share of the "
                         "stage (a hang, or a share too small: its log says how far it got)")
    if rc == 0:
        return OK, f"{tool}: {said}"
    if rc == 9:
        return FAILED, f"{tool}: KERNEL FAULT reported: {said}"
    if rc == 1:
        mismatch = [ln for ln in text.splitlines() if ln.startswith(("MISMATCH", "COVERAGE"))]
        return FAILED, f"{tool}: {(mismatch or ['cases failed (exit 1)'])[0]}"
    if rc == 2:
        return FAILED, f"{tool}: the CUDA ops are missing (build first)"
    return FAILED, f"{tool}: exit status {rc}; {said}"


def tools_that_fit(left_s: float, probe_s: float, remaining: int) -> int:
    """How many of the ``remaining`` tools to share ``left_s`` among: as many as get an equal
    share of at least ``MIN_SHARE_X`` x ``probe_s`` (each tool pays the probe's sanitized torch
    start-up before its first case), at most ``remaining``; 0: none may start."""
    floor_s = MIN_SHARE_X * max(probe_s, 1e-3)
    return max(0, min(remaining, int(left_s // floor_s)))


_RANK = {OK: 0, NOT_RUN: 1, TIMEOUT: 2, FAILED: 3}


# ---- stage bodies -------------------------------------------------------------------------------


def stage_env(ctx: Context) -> Result:
    py = ctx.python
    wheels = sorted(str(p) for p in (ROOT / ".whl").glob("*.whl"))
    lines = []
    if wheels:  # a failure here blocks only the stages that need the wheels (Stage.needs)
        rc = ctx.sh([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                     "--no-cache-dir", "--upgrade", "--target", SITE, *wheels], limit=20)
        names = ", ".join(Path(w).name for w in wheels)
        lines.append(f"env: installed {names} into {SITE}" if rc == 0 else
                     f"env: installing {names} FAILED (exit {rc}); the kernel stages run anyway")
    else:
        lines.append("env: no .whl/ carried: megatron-core and omegaconf come only from the image")
    ctx.sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
            "--format=csv,noheader"], limit=10)
    ctx.sh(["nvcc", "--version"], limit=5)
    rc = ctx.sh([py, "-c", ENV_PY])
    text = ctx.text()
    lines += summary_lines_of(text)
    missing = missing_modules("\n".join(summary_lines_of(text)))
    return Result(ctx.name, _status(rc), lines=lines, missing=missing,
                  detail="" if rc == 0 else "torch sees no CUDA device" if rc == 1 else "")


def stage_build(ctx: Context) -> Result:
    rc = ctx.sh([ctx.python, "setup.py", "build_ext", "--inplace"])
    if rc in (124, 137):
        return Result(ctx.name, TIMEOUT, detail="the compile did not finish")
    check = ctx.sh([ctx.python, "-c", BUILD_CHECK], limit=30)
    text = ctx.text()
    failed = [ln.strip() for ln in text.splitlines() if "hybridrl: building" in ln][:1]
    load = [ln for ln in summary_lines_of(text) if "extension load FAILED" in ln][:1]
    detail = (load or failed or [""])[0][:200]
    return Result(ctx.name, _status(rc or check), lines=summary_lines_of(text), detail=detail)


def _pytest(ctx: Context, paths: list[str], show: bool) -> Result:
    cmd = [ctx.python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *paths]
    rc = ctx.sh(cmd + (["-s"] if show else []))
    text = ctx.text()
    line = pytest_line(text)
    lines = summary_lines_of(text) + ([f"{ctx.name}: {line}"] if line else [])
    status, detail = pytest_verdict(rc, text)
    return Result(ctx.name, status, lines=lines, detail=detail)


def stage_tests(ctx: Context) -> Result:
    return _pytest(ctx, ["tests/gpu/test_kernels_cuda.py", "tests/gpu/test_layer_kernels_gpu.py"],
                   show=False)


def stage_models(ctx: Context) -> Result:
    return _pytest(ctx, ["tests/gpu/test_models_gpu.py", "tests/gpu/test_models_families_gpu.py",
                         "tests/gpu/test_packing_gpu.py", "tests/gpu/test_shared_attention_gpu.py"],
                   show=True)


def find_sanitizer() -> str | None:
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    path = Path(cuda) / "bin" / "compute-sanitizer"
    return str(path) if path.is_file() else None


def stage_sanitize(ctx: Context, tools=SANITIZER_TOOLS) -> Result:
    exe, py = find_sanitizer(), ctx.python
    if exe is None:
        return Result(ctx.name, UNAVAILABLE, detail="compute-sanitizer not found (PATH, "
                      "$CUDA_HOME/bin): no kernel verdict")
    probe_log = ctx.log.with_name("sanitize_probe.log")
    t0 = ctx.clock()
    rc = ctx.sh([exe, "--tool", "memcheck", "--error-exitcode", "9", py, "-c", PROBE],
                limit=PROBE_S, log=probe_log)
    probe_s = ctx.clock() - t0
    state, why = probe_verdict(rc, probe_log.read_text(errors="replace"))
    if state == "slow":
        return Result(ctx.name, NOT_RUN, detail=f"{why}: no verdict (slow is not unavailable; "
                      "rerun with a larger sanitize cap)")
    if state != "usable":
        plain = ctx.sh([py, "-c", PROBE], limit=30, log=probe_log)
        if plain != 0:
            return Result(ctx.name, FAILED, detail="a trivial torch program fails without the "
                          "sanitizer too: the GPU or torch is broken, not the sanitizer")
        if state == "failed":
            return Result(ctx.name, FAILED, detail="a trivial torch program fails under "
                          f"compute-sanitizer without a message of the tool ({why})")
        return Result(ctx.name, UNAVAILABLE, detail="sanitizer unavailable on this runtime: a "
                      f"trivial torch program fails under it, the tool says: {why}; no kernel "
                      "verdict")
    lines = [f"sanitize probe: {probe_s:.1f} s (a trivial torch program under memcheck)"]
    worst, detail_of_worst, names = OK, "", list(tools)
    cases = str(ROOT / "scripts" / "kernel_sanitizer_cases.py")
    for i, tool in enumerate(names):
        left = ctx.left()
        fit = tools_that_fit(left, probe_s, len(names) - i)
        if fit == 0:
            status = NOT_RUN
            lines.append(f"sanitize {', '.join(names[i:])}: NOT RUN - {left:.0f} s left, under "
                         f"{MIN_SHARE_X:g} x the probe's {probe_s:.1f} s per tool")
        else:
            share, log = left / fit, ctx.log.with_name(f"sanitize_{tool}.log")
            t0 = ctx.clock()
            rc = ctx.sh([exe, "--tool", tool, "--error-exitcode", "9", "--print-limit", "20", py,
                         cases, "--only", tools[tool]], limit=share,
                        env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, log=log)
            status, said = tool_verdict(tool, rc, log.read_text(errors="replace"), share)
            lines.append(f"sanitize {said} ({ctx.clock() - t0:.0f} s of a {share:.0f} s share)")
        if _RANK[status] > _RANK[worst]:  # the detail names the worst tool's line
            worst, detail_of_worst = status, lines[-1]
        if fit == 0:  # the tools after it are left out with it
            break
    return Result(ctx.name, worst, lines=lines, detail=detail_of_worst)


def stage_bench(ctx: Context) -> Result:
    base = [ctx.python, "-m", "benchmarks.kernels", "--device", "cuda", "--sizes", "4096x8192",
            "--repeat", "10", "--peak-gbs", str(PEAK_GBS)]
    lines, worst, missing = [], 0, []
    for label, extra in (("", ["--kinds", "low_var_kl,k3+"]),
                         ("bf16 ", ["--dtype", "bfloat16", "--only", "kl", "--kinds",
                                    "low_var_kl"])):
        before = len(ctx.text())
        rc = ctx.sh(base + extra)
        rows = bandwidth_lines(ctx.text()[before:], label)
        if rc == 0 and not rows:  # an exit 0 that measured nothing is no evidence
            missing.append(f"{label or 'fp32 '}run printed no bandwidth row")
        worst = worst or rc
        lines += rows
    if missing and not worst:
        return Result(ctx.name, FAILED, lines=lines, detail="; ".join(missing))
    return Result(ctx.name, _status(worst), lines=lines)


def stage_engine(ctx: Context) -> Result:
    # the ~30M "small" llama: transformers initializes its model on the CPU with a serial random
    # generator (a 1.1B model: about a minute whatever the thread count), which no cap here fits
    rc = ctx.sh([ctx.python, "benchmarks/rollout_engine.py", "--device", "cuda", "--dtype",
                 "bf16", "--size", "small", "--batch", "32", "--prompt", "128", "--new", "128",
                 "--rounds", "3"])
    keep = ("builtin engine", "transformers generate", "ratio ")
    lines = [f"engine: {ln.strip()}" for ln in ctx.text().splitlines() if ln.startswith(keep)]
    return Result(ctx.name, _status(rc), lines=lines)


def stage_ppo(ctx: Context) -> Result:
    rc = ctx.sh([ctx.python, "scripts/gpu_ppo_step.py", "--device", "cuda", "--size", "0.5b",
                 "--arch", "llama,qwen3", "--steps", "3"])
    return Result(ctx.name, _status(rc), lines=summary_lines_of(ctx.text()))


RUNNERS = {"env": stage_env, "build": stage_build, "tests": stage_tests,
           "sanitize": stage_sanitize, "bench": stage_bench, "models": stage_models,
           "engine": stage_engine, "ppo": stage_ppo}
