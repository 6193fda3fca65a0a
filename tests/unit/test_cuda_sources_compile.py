"""The CUDA sources (csrc/cuda/*.cu) compile with this machine's nvcc.

On a machine without a GPU the CUDA extension is never built, so without this check a syntax or
type error in the .cu files could land unnoticed. ``csrc/check_cuda.sh`` compiles each file for
sm_90 against the installed torch's headers (compile only: nothing is linked or run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~70 s of CPU (three nvcc compiles): out of `make test-quick`
@pytest.mark.skipif(shutil.which("nvcc") is None,
                    reason="nvcc not found: the CUDA sources are compile-checked only where "
                           "nvcc is installed")
def test_cuda_sources_compile_with_nvcc():
    proc = subprocess.run(["bash", str(ROOT / "csrc" / "check_cuda.sh"), "sm_90"],
                          env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert "ok: csrc/cuda compiles" in proc.stdout
