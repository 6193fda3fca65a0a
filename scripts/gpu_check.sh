#!/usr/bin/env bash
# The GPU check, one command for a session lent the H200 (the device tool's `run`, repository
# root; its python3 holds a CUDA torch, pytest and ninja; nvcc and compute-sanitizer come with the
# CUDA toolkit). Named stages inside one time budget; the plan and its caps are
# scripts/gpu_plan.py's, the rules and the output files scripts/gpu_check.py's (what each stage
# runs: scripts/gpu_stages.py; docs/gpu.md says how to read the result):
#   bash scripts/gpu_check.sh --dry-run                 # the stage plan with its caps
#   bash scripts/gpu_check.sh                           # every stage, <= 580 s
#   bash scripts/gpu_check.sh --steps build,tests,sanitize,bench   # the critical path, <= 410 s
#   bash scripts/gpu_check.sh --steps ppo --allow-partial
# Writes summary.txt and gpu_check_logs.tar.gz to $OUT (else ./gpu_out). Exit status: 0 all
# selected stages passed, 1 one failed or timed out, 3 one did not run (unless --allow-partial),
# 2 bad arguments. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
