#!/usr/bin/env bash
# The GPU checks of the kernels, as one command for a session lent the H200 (the device tool's
# `run`, repository root; its python3 holds a CUDA torch, pytest and ninja). Steps:
#   1. build hybridrl._C and hybridrl._C_cuda in place for sm_90 with that python3;
#   2. tests/gpu/test_kernels_cuda.py (fails if a CUDA kernel is missing, see its docstring);
#   3. python -m benchmarks.kernels --device cuda --sizes 4096x8192 (and 1024x4096).
# Logs go to $OUT (the device tool brings them back) or ./gpu_out. Exit status: that of the
# tests. Pure-Python packages the image lacks can travel as wheels in .whl/ (device README).
# Budget: ~2 min build + ~1 min tests + ~1 min benchmark on 16 cores.
set -uo pipefail
out="${OUT:-gpu_out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv; "$py" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)';
  nvcc --version | tail -2; } >"$out/env.txt" 2>&1
cat "$out/env.txt"

echo "== build (log: $out/build.log)"
"$py" setup.py build_ext --inplace >"$out/build.log" 2>&1
grep -iE "error|failed|warning: hybridrl" "$out/build.log" | head -20
"$py" -c 'import hybridrl.kernels.ops as o; o.load(); print("cuda kernels:",
  {n: o.compiled_available(n, "cuda") for n in o.OP_NAMES})' 2>&1 | tee -a "$out/build.log"

echo "== tests (log: $out/tests.log)"
"$py" -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_cuda.py >"$out/tests.log" 2>&1
status=$?
tail -15 "$out/tests.log"

echo "== benchmark (log: $out/bench.log)"
"$py" -m benchmarks.kernels --device cuda --sizes 1024x4096,4096x8192 \
  --kinds low_var_kl,k3+,k2 2>&1 | tee "$out/bench.log"
exit "$status"
