"""The GPU check of hybridrl in named stages inside one time budget (``scripts/gpu_check.sh``).

    bash scripts/gpu_check.sh [--steps build,tests,sanitize,bench,models,engine,ppo]
                              [--dry-run] [--allow-partial] [--budget S] [--out DIR]

Contract (stdlib only, so ``--dry-run`` and the rules below run anywhere, tested without a GPU):
- Stages, always in this order: ``env`` (carried wheels, versions; always first), then those of
  ``--steps`` (default all); the plan, its caps and budget are ``scripts/gpu_plan.py``'s.
  ``build``, ``tests``, ``sanitize`` and ``bench`` are the critical path: their caps with
  ``env``'s sum to at most ``CRITICAL_MAX_S`` (410 s); every cap sums to at most
  ``BUDGET_S`` (580 s, inside the device tool's 600 s command limit), the default ``--budget``.
- Time rule: a stage starts only when its whole cap fits in what is left of the budget, and runs
  under a hard timeout of its cap (its process group is killed). A stage that does not fit is
  NOT RUN ("skipped for time").
- Dependencies: every stage after ``env`` is NOT RUN ("env did not pass") when ``env`` is not
  ok (no CUDA device); a stage whose ``needs`` (megatron.core, omegaconf: the carried wheels)
  did not import in ``env`` is NOT RUN naming them, the kernel stages (which need none) run;
  ``tests``/``sanitize``/``bench`` are NOT RUN when ``build`` was selected and did not pass.
- Evidence: no stage reads ok without it (``scripts/gpu_stages.py``): a pytest stage in which
  no test ran (all skipped, none collected) is NOT RUN; bench fails when a run printed no
  bandwidth row; build fails with the extension's load error; ``sanitize`` is UNAVAILABLE only
  when compute-sanitizer itself says it cannot use the device (its ``=========`` lines), a probe
  that is merely slow is NOT RUN, one that fails without such a message FAILED; NOT RUN also
  when a sanitizer tool's share of the time was too short to start it.
- Exit status: 1 when a stage FAILED or hit its TIMEOUT; else 3 when a selected stage did not
  run (NOT RUN or UNAVAILABLE) unless ``--allow-partial``; else 0. 2: bad arguments.
- Files: ``--out`` (default ``$OUT``, else ``./gpu_out``) receives exactly ``summary.txt`` and
  ``gpu_check_logs.tar.gz`` (every stage's log), both rewritten after each stage, so a run that
  is cut short still returns what it did. Logs are written outside ``--out`` (``--log-dir``).
- ``summary.txt``: one line per stage (``name: verdict in S s (cap C s)``), then the result lines
  the stages report (a command's output lines that start with ``SUMMARY: ``, and the lines the
  stage bodies derive), then ``times:`` (every stage's measured seconds / cap: the caps are
  estimates until a run measured them), then ``verdict: PASS | FAIL | INCOMPLETE`` and the exit
  status.
The stage bodies (what each one runs) live in ``scripts/gpu_stages.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import gpu_stages
from gpu_plan import (
    BUDGET_S,
    CRITICAL_MAX_S,
    FAILED,
    NOT_RUN,
    OK,
    SETUP,
    STAGE_NAMES,
    STAGES,
    TIMEOUT,
    UNAVAILABLE,
    Context,
    Result,
    Stage,
)

SUMMARY_FILE = "summary.txt"
ARCHIVE_FILE = "gpu_check_logs.tar.gz"


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
        needs = f" [needs {', '.join(s.needs)}]" if s.needs else ""
        lines.append(f"{s.name:<9}{s.cap_s:>6}  {'critical' if s.critical else 'rest':<9} "
                     f"{s.what}{needs}")
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


def blocked_by(stage: Stage, results: Mapping[str, Result], setup: str = SETUP.name) -> str:
    """Why ``stage`` must not start ("" when it may): ``setup`` (env) ran and was not ok (no CUDA:
    every GPU stage would fail and burn the device time), the stage needs a module that did not
    import in env (the wheels), or it needs ``build``, which was selected and did not pass."""
    env = results.get(setup)
    if env is not None and env.status != OK:
        return f"{setup} did not pass ({env.status}{': ' + env.detail if env.detail else ''})"
    lacking = [m for m in stage.needs if env is not None and m in env.missing]
    if lacking:
        return (f"needs {', '.join(lacking)}, which did not import in {setup} (the carried "
                f"wheels, .whl/)")
    build = results.get("build")
    if stage.needs_build and build is not None and build.status != OK:
        return "build did not pass"
    return ""


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


def started(r: Result) -> bool:
    """Whether the stage's body ran (a sanitize stage whose tools did not all fit is NOT RUN
    after its measured seconds)."""
    return r.status != NOT_RUN or r.seconds > 0


def result_line(r: Result, cap_s: int) -> str:
    took = f" in {r.seconds:.0f} s (cap {cap_s} s)" if started(r) else ""
    return f"{r.stage}: {r.status}{took}" + (f" - {r.detail}" if r.detail else "")


def times_line(results: Sequence[Result], caps: Mapping[str, int]) -> str:
    """Each stage's measured seconds next to its cap, to retune the caps (gpu_plan.py) from."""
    cells = [f"{r.stage} {r.seconds:.0f}/{caps[r.stage]}" if started(r)
             else f"{r.stage} -/{caps[r.stage]}" for r in results]
    return "times (measured s / cap s, - = not started): " + ", ".join(cells)


def summary_text(results: Sequence[Result], caps: Mapping[str, int], budget_s: int,
                 elapsed_s: float, allow_partial: bool, final: bool) -> str:
    lines = [result_line(r, caps[r.stage]) for r in results]
    lines += [line for r in results for line in r.lines]
    lines.append(times_line(results, caps))
    lines.append(f"time: {elapsed_s:.0f} s of the {budget_s} s budget")
    lines.append(verdict_line(results, allow_partial) if final else "verdict: still running")
    return "\n".join(lines) + "\n"


# ---- side effects: commands, logs, the two output files ----------------------------------------


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
              echo: Callable[[str], None] = print,
              clock: Callable[[], float] = time.monotonic) -> int:
    """Run ``setup`` and ``selected`` by the time and dependency rules; the exit status.
    ``clock`` (seconds) measures the budget, the stages' deadlines and their times."""
    start = clock()
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = ([setup] if setup else []) + list(selected)
    caps = {s.name: s.cap_s for s in rows}
    results: list[Result] = []
    done: dict[str, Result] = {}
    for stage in rows:
        left = budget_s - (clock() - start)
        blocker = blocked_by(stage, done, setup.name if setup else SETUP.name)
        if blocker:
            res = Result(stage.name, NOT_RUN, detail=blocker)
        elif not may_start(stage, left):
            res = Result(stage.name, NOT_RUN, detail=f"skipped for time: {left:.0f} s of the "
                         f"budget left, cap {stage.cap_s} s")
        else:
            echo(f"== {stage.name} (cap {stage.cap_s} s, {left:.0f} s of the budget left)")
            ctx = Context(stage.name, log_dir / f"{stage.name}.log", clock() + stage.cap_s,
                          dict(env), python, clock)
            t0 = clock()
            try:
                res = runners[stage.name](ctx)
            except Exception as err:  # a broken stage body is that stage's failure, not the run's
                res = Result(stage.name, FAILED, detail=f"{type(err).__name__}: {err}")
            res.seconds = clock() - t0
            if res.status in (FAILED, TIMEOUT):
                tail = ctx.text().splitlines()[-25:]
                echo("\n".join(f"   | {ln}" for ln in tail))
        echo(result_line(res, stage.cap_s))
        for line in res.lines:
            echo(f"   {line}")
        results.append(res)
        done[stage.name] = res
        write_outputs(out_dir, log_dir, summary_text(results, caps, budget_s, clock() - start,
                                                     allow_partial, final=False))
    summary = summary_text(results, caps, budget_s, clock() - start, allow_partial, final=True)
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
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gpu_check_")) / "logs"
    python = os.environ.get("PYTHON", "python3")
    return run_check(selected, gpu_stages.RUNNERS, budget_s=args.budget, out_dir=Path(args.out),
                     log_dir=log_dir, env=gpu_stages.base_env(), python=python,
                     allow_partial=args.allow_partial)


if __name__ == "__main__":
    sys.exit(main())
