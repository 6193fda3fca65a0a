"""The GPU check's shared pieces: the stage plan (names, caps, budget), the verdict words, a
stage's result and the context a stage body runs in (``scripts/gpu_check.py`` runs the plan,
``scripts/gpu_stages.py`` holds the bodies; both import this module, which imports neither).

Contract (stdlib only):
- ``SETUP`` (``env``) and ``STAGES``, in run order, each a ``Stage`` with its cap in seconds. The
  caps are estimates, never measured on the H200 (build's is sized from compile times measured
  on CPU, ``BUILD_MEASURED_S``): replace them by the first run's measured times (summary.txt's
  ``times:`` line). Critical stages (with ``env``) sum to at most ``CRITICAL_MAX_S``, all of
  them to at most ``BUDGET_S`` (tests/unit/test_gpu_check.py checks the dry-run's sums).
- ``Stage.needs``: the modules a stage imports that only the carried wheels bring (megatron.core,
  omegaconf: the device image lacks them). The kernel stages need none, so they run whether or
  not the wheels installed; env reports what did not import (``Result.missing``) and a stage
  that needs it is NOT RUN.
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

BUDGET_S = 580  # a full run, inside the device tool's 600 s command limit (20 s for the rest)
CRITICAL_MAX_S = 410  # env + build + tests + sanitize + bench
# single-file compile times measured on CPU (2 cores, under load): setup.py builds hybridrl._C
# (kl_cpu.cpp ...) and then hybridrl._C_cuda, whose .cu files ninja compiles side by side: about
# 19 + 71 s of compiling plus torch's import and the links; the cap doubles that
BUILD_MEASURED_S = {"gae_cuda.cu": 71, "kl_cuda.cu": 68, "kl_cpu.cpp": 19}
WHEELS = ("megatron.core", "omegaconf")  # what .whl/ carries (scripts/gpu_wheels.sh)
SUMMARY_PREFIX = "SUMMARY: "
OK, FAILED, TIMEOUT, NOT_RUN, UNAVAILABLE = "ok", "FAILED", "TIMEOUT", "NOT RUN", "UNAVAILABLE"


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    cap_s: int
    critical: bool
    needs_build: bool  # pointless when `build` was selected and did not pass
    what: str
    needs: tuple[str, ...] = ()  # modules only the carried wheels bring (NOT RUN without them)


# env: pip install --no-compile of the wheels, then cold imports of torch, megatron.core and
# transformers on a fresh machine (each can take seconds with a cold disk cache)
SETUP = Stage("env", 30, True, False, "install .whl/*.whl to /tmp/site; GPU, driver, Python, "
              "torch, nvcc versions; which of megatron-core, omegaconf, transformers import "
              "(fails only without a CUDA device: missing wheels block only the stages that "
              "need them)")
STAGES = (
    Stage("build", 180, True, False, "setup.py build_ext --inplace (sm_90, 16 jobs; measured "
          "on CPU: gae_cuda.cu 71 s, kl_cuda.cu 68 s, kl_cpu.cpp 19 s); fails unless every "
          "hybridrl op has a CUDA kernel (an extension load error fails it, with the error)"),
    Stage("tests", 65, True, True, "pytest tests/gpu/test_kernels_cuda.py (each kernel vs its "
          "reference and the GAE emulation) and test_layer_kernels_gpu.py (RMSNorm, SwiGLU, "
          "RoPE take torch's ops on CUDA); every test skipped = NOT RUN"),
    Stage("sanitize", 100, True, True, "probe (timed; UNAVAILABLE only on the tool's own "
          "message); then compute-sanitizer memcheck, racecheck, synccheck, initcheck on "
          "scripts/kernel_sanitizer_cases.py while each tool's share of the time left is >= "
          "1.5x the probe's time"),
    Stage("bench", 35, True, True, "benchmarks.kernels at 4096x8192 (fp32; KL bf16 too) vs "
          "4800 GB/s, goal >= 50% for gae and kl; a run with no bandwidth row fails"),
    Stage("models", 65, False, False, "pytest -s tests/gpu/test_models_gpu.py, "
          "test_models_families_gpu.py: NCCL vs transformers (llama, llama 3, qwen3, qwen2.5); "
          "~1B llama step: tokens/s, MFU, peak vs plan --memory; test_packing_gpu.py: packed "
          "= padded (megatron's THD path on TE: skipped on an image without it); "
          "test_shared_attention_gpu.py: shared-prompt attention in the flash kernel with GQA",
          needs=WHEELS),
    Stage("engine", 30, False, False, "benchmarks/rollout_engine.py: builtin engine vs "
          "transformers generate, ~30M llama bf16, batch 32, 128 + 128 tokens", needs=WHEELS),
    Stage("ppo", 75, False, False, "scripts/gpu_ppo_step.py: 3 GRPO steps each of a ~0.5B "
          "llama and a ~0.44B Qwen3 (builtin engine + megatron, bf16): tokens/s, MFU, memory",
          needs=WHEELS),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


@dataclasses.dataclass
class Result:
    stage: str
    status: str  # OK | FAILED | TIMEOUT | NOT_RUN | UNAVAILABLE
    seconds: float = 0.0  # measured by gpu_check.run_check; 0 for a stage never started
    detail: str = ""
    lines: list[str] = dataclasses.field(default_factory=list)  # result lines for the summary
    missing: tuple[str, ...] = ()  # env: modules that did not import (stages needing them wait)


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
