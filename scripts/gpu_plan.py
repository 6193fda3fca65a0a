"""The GPU check's shared pieces: the stage plan (names, caps, budget), the verdict words, a
stage's result and the context a stage body runs in (``scripts/gpu_check.py`` runs the plan,
``scripts/gpu_stages.py`` holds the bodies; both import this module, which imports neither).

Contract (stdlib only):
- ``SETUP`` (``env``) and ``STAGES``, in run order, each a ``Stage`` with its cap in seconds. The
  caps are estimates, never measured on the H200: replace them by the first run's measured times
  (summary.txt's ``times:`` line). Critical stages (with ``env``) sum to at most ``CRITICAL_MAX_S``,
  all of them to at most ``BUDGET_S`` (tests/unit/test_gpu_check.py checks the dry-run's sums).
- Verdicts: ``OK``, ``FAILED``, ``TIMEOUT``, ``NOT_RUN``, ``UNAVAILABLE``.
- ``Context.sh`` runs one command in its own process group, output appended to the stage's log,
  under min(limit, the stage's time left); 124 when it ran out of time (the group is killed).
- ``summary_lines_of``: the lines a command printed with the ``SUMMARY: `` prefix, prefix removed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

BUDGET_S = 540  # a full run: 9 minutes, inside the device tool's 10-minute command limit
CRITICAL_MAX_S = 360  # env + build + tests + sanitize + bench: 6 minutes
SUMMARY_PREFIX = "SUMMARY: "
OK, FAILED, TIMEOUT, NOT_RUN, UNAVAILABLE = "ok", "FAILED", "TIMEOUT", "NOT RUN", "UNAVAILABLE"


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    cap_s: int
    critical: bool
    needs_build: bool  # pointless when `build` was selected and did not pass
    what: str


# env: pip install --no-compile of the wheels, then cold imports of torch, megatron.core and
# transformers on a fresh machine (each can take seconds with a cold disk cache)
SETUP = Stage("env", 30, True, False, "install .whl/*.whl to /tmp/site; GPU, driver, torch, "
              "nvcc versions; which of megatron-core, omegaconf, transformers import")
STAGES = (
    Stage("build", 120, True, False, "setup.py build_ext --inplace (sm_90, 16 jobs); fails "
          "unless every hybridrl op has a CUDA kernel"),
    Stage("tests", 65, True, True, "pytest tests/gpu/test_kernels_cuda.py (each kernel vs its "
          "reference and the GAE emulation)"),
    Stage("sanitize", 110, True, True, "probe (timed); then compute-sanitizer memcheck, "
          "racecheck, synccheck, initcheck on scripts/kernel_sanitizer_cases.py while each "
          "tool's share of the time left is >= 1.5x the probe's time"),
    Stage("bench", 35, True, True, "benchmarks.kernels at 4096x8192 (fp32; KL bf16 too) vs "
          "4800 GB/s, goal >= 50% for gae and kl"),
    Stage("models", 65, False, False, "pytest -s tests/gpu/test_models_gpu.py, "
          "test_models_families_gpu.py: NCCL vs transformers (llama, llama 3, qwen3, qwen2.5); "
          "~1B llama step: tokens/s, MFU, peak vs plan --memory; test_packing_gpu.py: packed "
          "= padded (megatron's THD path on TE)"),
    Stage("engine", 30, False, False, "benchmarks/rollout_engine.py: builtin engine vs "
          "transformers generate, ~30M llama bf16, batch 32, 128 + 128 tokens"),
    Stage("ppo", 75, False, False, "scripts/gpu_ppo_step.py: 3 GRPO steps each of a ~0.5B "
          "llama and a ~0.44B Qwen3 (builtin engine + megatron, bf16): tokens/s, MFU, memory"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


@dataclasses.dataclass
class Result:
    stage: str
    status: str  # OK | FAILED | TIMEOUT | NOT_RUN | UNAVAILABLE
    seconds: float = 0.0  # measured by gpu_check.run_check; 0 for a stage never started
    detail: str = ""
    lines: list[str] = dataclasses.field(default_factory=list)  # result lines for the summary


def summary_lines_of(text: str) -> list[str]:
    """The lines a command reported for the summary (``SUMMARY: `` prefix removed)."""
    return [ln[len(SUMMARY_PREFIX):].rstrip() for ln in text.splitlines()
            if ln.startswith(SUMMARY_PREFIX)]


@dataclasses.dataclass
class Context:
    """What a stage body gets: its log, its deadline, the environment of its commands."""

    name: str
    log: Path
    deadline: float  # clock() at which the stage's cap ends
    env: dict
    python: str
    clock: Callable[[], float] = time.monotonic

    def left(self) -> float:
        return self.deadline - self.clock()

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
