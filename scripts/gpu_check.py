"""The GPU check of hybridrl in named stages inside one time budget (``scripts/gpu_check.sh``).

    bash scripts/gpu_check.sh [--steps build,tests,sanitize,bench,models,engine,ppo]
                              [--dry-run] [--allow-partial] [--budget S] [--out DIR]

Contract (stdlib only, so ``--dry-run`` and the rules below run anywhere, tested without a GPU):
- Stages, always in this order: ``env`` (carried wheels, versions; always first), then those of
  ``--steps`` (default all). ``build``, ``tests``, ``sanitize`` and ``bench`` are the critical
  path: their caps with ``env``'s sum to at most ``CRITICAL_MAX_S`` (6 minutes); every cap sums
  to at most ``BUDGET_S`` (9 minutes), the default ``--budget``.
- Time rule: a stage starts only when its whole cap fits in what is left of the budget, and runs
  under a hard timeout of its cap (its process group is killed). A stage that does not fit is
  NOT RUN ("skipped for time"); so is ``tests``/``sanitize``/``bench`` when ``build`` was
  selected and did not pass. ``sanitize`` is UNAVAILABLE when compute-sanitizer cannot run a
  trivial torch program on this runtime (a probe tells this from a kernel fault).
- Exit status: 1 when a stage FAILED or hit its TIMEOUT; else 3 when a selected stage did not
  run (NOT RUN or UNAVAILABLE) unless ``--allow-partial``; else 0. 2: bad arguments.
- Files: ``--out`` (default ``$OUT``, else ``./gpu_out``) receives exactly ``summary.txt`` and
  ``gpu_check_logs.tar.gz`` (every stage's log), both rewritten after each stage, so a run that
  is cut short still returns what it did. Logs are written outside ``--out`` (``--log-dir``).
- ``summary.txt``: one line per stage (``name: verdict in S s (cap C s)``), then the result lines
  the stages report (a command's output lines that start with ``SUMMARY: ``, and the lines the
  stage bodies derive), then ``verdict: PASS | FAIL | INCOMPLETE`` and the exit status.
The stage bodies (what each one runs) live in ``scripts/gpu_stages.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

BUDGET_S = 540  # a full run: 9 minutes, inside the device tool's 10-minute command limit
CRITICAL_MAX_S = 360  # env + build + tests + sanitize + bench: 6 minutes
SUMMARY_FILE = "summary.txt"
ARCHIVE_FILE = "gpu_check_logs.tar.gz"
SUMMARY_PREFIX = "SUMMARY: "
OK, FAILED, TIMEOUT, NOT_RUN, UNAVAILABLE = "ok", "FAILED", "TIMEOUT", "NOT RUN", "UNAVAILABLE"


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    cap_s: int
    critical: bool
    needs_build: bool  # pointless when `build` was selected and did not pass
    what: str


SETUP = Stage("env", 15, True, False, "install .whl/*.whl to /tmp/site; GPU, driver, torch, "
              "nvcc versions; which of megatron-core, omegaconf, transformers import")
STAGES = (
    Stage("build", 120, True, False, "setup.py build_ext --inplace (sm_90, 16 jobs); fails "
          "unless every hybridrl op has a CUDA kernel"),
    Stage("tests", 70, True, True, "pytest tests/gpu/test_kernels_cuda.py (each kernel vs its "
          "reference and the GAE emulation)"),
    Stage("sanitize", 110, True, True, "probe; then compute-sanitizer memcheck, racecheck, "
          "synccheck, initcheck on scripts/kernel_sanitizer_cases.py"),
    Stage("bench", 40, True, True, "benchmarks.kernels at 4096x8192 (fp32; KL bf16 too) vs "
          "4800 GB/s, goal >= 50% for gae and kl"),
    Stage("models", 65, False, False, "pytest -s tests/gpu/test_models_gpu.py, "
          "test_models_families_gpu.py: NCCL vs transformers (llama, llama 3, qwen3, qwen2.5); "
          "~1B llama step: tokens/s, MFU, peak vs plan --memory"),
    Stage("engine", 40, False, False, "benchmarks/rollout_engine.py: builtin engine vs "
          "transformers generate, ~30M llama bf16, batch 32, 128 + 128 tokens"),
    Stage("ppo", 75, False, False, "scripts/gpu_ppo_step.py: 3 GRPO steps each of a ~0.5B "
          "llama and a ~0.44B Qwen3 (builtin engine + megatron, bf16): tokens/s, MFU, memory"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


@dataclasses.dataclass
class Result:
    stage: str
    status: str  # OK | FAILED | TIMEOUT | NOT_RUN | UNAVAILABLE
    seconds: float = 0.0
    detail: str = ""
    lines: list[str] = dataclasses.field(default_factory=list)  # result lines for the summary


# ---- pure rules --------------------------------------------------------------------------------


def parse_steps(text: str | None, stages: Sequence[Stage] = STAGES) -> list[Stage]:
    """The selected stages in run order; ValueError naming an unknown or empty selection."""
    if text is None or text.strip() in ("", "all"):
        return list(stages)
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = {s.name for s in stages}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--steps: unknown stage(s) {unknown or text!r}; allowed: "
                         f"{','.join(s.name for s in stages)} (or all)")
    return [s for s in stages if s.name in names]


def plan_lines(selected: Sequence[Stage], budget_s: int, setup: Stage = SETUP) -> list[str]:
    """The ``--dry-run`` plan: one line per stage with its cap, the critical path and the total
    against the budget, and whether every cap fits."""
    rows = [setup, *selected]
    lines = [f"{'stage':<9}{'cap s':>6}  {'path':<9} what"]
    for s in rows:
        lines.append(f"{s.name:<9}{s.cap_s:>6}  {'critical' if s.critical else 'rest':<9} "
                     f"{s.what}")
    critical = sum(s.cap_s for s in rows if s.critical)
    total = sum(s.cap_s for s in rows)
    lines.append(f"critical path (env + build + tests + sanitize + bench as selected): "
                 f"{critical} s of at most {CRITICAL_MAX_S} s")
    if total <= budget_s:
        lines.append(f"total: {total} s of caps within the {budget_s} s budget: every stage fits")
    else:
        late = late_stages(rows, budget_s)
        lines.append(f"total: {total} s of caps EXCEEDS the {budget_s} s budget: "
                     f"{', '.join(late)} would be NOT RUN if earlier stages used their caps")
    return lines


def late_stages(rows: Sequence[Stage], budget_s: int) -> list[str]:
    """Stages whose cap no longer fits once every earlier stage used its whole cap."""
    used, late = 0, []
    for s in rows:
        if used + s.cap_s > budget_s:
            late.append(s.name)
        else:
            used += s.cap_s
    return late


def may_start(stage: Stage, left_s: float) -> bool:
    """The time rule: a stage starts only when its whole cap fits in the budget left."""
    return stage.cap_s <= left_s


def blocked_by_build(stage: Stage, results: Mapping[str, Result]) -> bool:
    build = results.get("build")
    return stage.needs_build and build is not None and build.status != OK


def exit_status(results: Sequence[Result], allow_partial: bool) -> int:
    statuses = {r.status for r in results}
    if statuses & {FAILED, TIMEOUT}:
        return 1
    if statuses & {NOT_RUN, UNAVAILABLE} and not allow_partial:
        return 3
    return 0


def verdict_line(results: Sequence[Result], allow_partial: bool) -> str:
    code = exit_status(results, allow_partial)
    bad = [f"{r.stage} {r.status}" for r in results if r.status != OK]
    if code == 1:
        word = "FAIL"
    elif bad:
        word = "INCOMPLETE" + (" (allowed: --allow-partial)" if allow_partial else "")
    else:
        word = "PASS"
    ran = sum(r.status in (OK, FAILED, TIMEOUT) for r in results)
    tail = f"; not ok: {', '.join(bad)}" if bad else ""
    return f"verdict: {word}: {ran} of {len(results)} stages ran{tail} (exit {code})"


def result_line(r: Result, cap_s: int) -> str:
    took = f" in {r.seconds:.0f} s (cap {cap_s} s)" if r.status != NOT_RUN else ""
    return f"{r.stage}: {r.status}{took}" + (f" - {r.detail}" if r.detail else "")


def summary_text(results: Sequence[Result], caps: Mapping[str, int], budget_s: int,
                 elapsed_s: float, allow_partial: bool, final: bool) -> str:
    lines = [result_line(r, caps[r.stage]) for r in results]
    lines += [line for r in results for line in r.lines]
    lines.append(f"time: {elapsed_s:.0f} s of the {budget_s} s budget")
    lines.append(verdict_line(results, allow_partial) if final else "verdict: still running")
    return "\n".join(lines) + "\n"


def summary_lines_of(text: str) -> list[str]:
    """The lines a command reported for the summary (``SUMMARY: `` prefix removed)."""
    return [ln[len(SUMMARY_PREFIX):].rstrip() for ln in text.splitlines()
            if ln.startswith(SUMMARY_PREFIX)]


# ---- side effects: commands, logs, the two output files ----------------------------------------


@dataclasses.dataclass
class Context:
    """What a stage body gets: its log, its deadline, the environment of its commands."""

    name: str
    log: Path
    deadline: float  # time.monotonic() at which the stage's cap ends
    env: dict
    python: str

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def sh(self, cmd: Sequence[str], limit: float | None = None, env: Mapping | None = None,
           log: Path | None = None) -> int:
        """Run ``cmd`` (output appended to the log) under min(limit, stage time left); 124 when
        it ran out of time."""
        budget = self.left() if limit is None else min(limit, self.left())
        return run_command(cmd, log or self.log, budget, {**self.env, **(env or {})})

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def run_command(cmd: Sequence[str], log: Path, timeout_s: float, env: Mapping) -> int:
    """Run ``cmd`` in its own process group, stdout and stderr appended to ``log``; on timeout
    the whole group is killed and 124 returned."""
    if timeout_s <= 0:
        return 124
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=dict(env),
                                    start_new_session=True)
        except OSError as err:
            f.write(f"cannot start: {err}\n")
            return 127
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            f.write(f"\n[gpu_check] killed after {timeout_s:.0f} s\n")
            return 124


def write_outputs(out_dir: Path, log_dir: Path, summary: str) -> None:
    """summary.txt and the log archive in ``out_dir``, each replaced atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / SUMMARY_FILE).write_text(summary)
    tmp = out_dir / f".{SUMMARY_FILE}.tmp"
    tmp.write_text(summary)
    os.replace(tmp, out_dir / SUMMARY_FILE)
    with tempfile.NamedTemporaryFile(dir=log_dir.parent, suffix=".tar.gz", delete=False) as f:
        archive = Path(f.name)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(log_dir, arcname="gpu_check_logs")
    archive.chmod(0o644)
    os.replace(archive, out_dir / ARCHIVE_FILE)


Runner = Callable[[Context], Result]


def run_check(selected: Sequence[Stage], runners: Mapping[str, Runner], *, budget_s: int,
              out_dir: Path, log_dir: Path, env: Mapping, python: str,
              allow_partial: bool = False, setup: Stage | None = SETUP,
              echo: Callable[[str], None] = print) -> int:
    """Run ``setup`` and ``selected`` by the time and dependency rules; the exit status."""
    start = time.monotonic()
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = ([setup] if setup else []) + list(selected)
    caps = {s.name: s.cap_s for s in rows}
    results: list[Result] = []
    done: dict[str, Result] = {}
    for stage in rows:
        left = budget_s - (time.monotonic() - start)
        if not may_start(stage, left):
            res = Result(stage.name, NOT_RUN, detail=f"skipped for time: {left:.0f} s of the "
                         f"budget left, cap {stage.cap_s} s")
        elif blocked_by_build(stage, done):
            res = Result(stage.name, NOT_RUN, detail="build did not pass")
        else:
            echo(f"== {stage.name} (cap {stage.cap_s} s, {left:.0f} s of the budget left)")
            ctx = Context(stage.name, log_dir / f"{stage.name}.log",
                          time.monotonic() + stage.cap_s, dict(env), python)
            t0 = time.monotonic()
            try:
                res = runners[stage.name](ctx)
            except Exception as err:  # a broken stage body is that stage's failure, not the run's
                res = Result(stage.name, FAILED, detail=f"{type(err).__name__}: {err}")
            res.seconds = time.monotonic() - t0
            if res.status in (FAILED, TIMEOUT):
                tail = ctx.text().splitlines()[-25:]
                echo("\n".join(f"   | {ln}" for ln in tail))
        echo(result_line(res, stage.cap_s))
        for line in res.lines:
            echo(f"   {line}")
        results.append(res)
        done[stage.name] = res
        write_outputs(out_dir, log_dir, summary_text(results, caps, budget_s,
                                                     time.monotonic() - start, allow_partial,
                                                     final=False))
    summary = summary_text(results, caps, budget_s, time.monotonic() - start, allow_partial,
                           final=True)
    write_outputs(out_dir, log_dir, summary)
    echo("== summary (" + str(out_dir / SUMMARY_FILE) + ")\n" + summary.rstrip())
    return exit_status(results, allow_partial)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default=None, help=f"comma list of {','.join(STAGE_NAMES)} "
                    "(default: all)")
    ap.add_argument("--dry-run", action="store_true", help="print the stage plan and exit")
    ap.add_argument("--allow-partial", action="store_true",
                    help="exit 0 when nothing failed even if a stage did not run")
    ap.add_argument("--budget", type=int, default=int(os.environ.get("GPU_CHECK_BUDGET_S",
                                                                     BUDGET_S)),
                    help=f"seconds for the whole run (default {BUDGET_S})")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_out",
                    help="folder for summary.txt and the log archive (default $OUT or gpu_out)")
    ap.add_argument("--log-dir", default=None, help="where the logs are written (default: a "
                    "fresh folder under /tmp)")
    args = ap.parse_args(argv)
    try:
        selected = parse_steps(args.steps)
    except ValueError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    if args.budget <= 0:
        print(f"gpu_check: --budget must be > 0 s, got {args.budget}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("\n".join(plan_lines(selected, args.budget)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.modules.setdefault("gpu_check", sys.modules[__name__])  # one copy when run as a script
    import gpu_stages

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gpu_check_")) / "logs"
    python = os.environ.get("PYTHON", "python3")
    return run_check(selected, gpu_stages.RUNNERS, budget_s=args.budget, out_dir=Path(args.out),
                     log_dir=log_dir, env=gpu_stages.base_env(), python=python,
                     allow_partial=args.allow_partial)


if __name__ == "__main__":
    sys.exit(main())
