#!/usr/bin/env bash
# Compile-only check of csrc/cuda/*.cu with nvcc, usable on a machine whose torch is the CPU
# build (it ships ATen/c10 CUDA headers but not the generated c10/cuda/impl/cuda_cmake_macros.h,
# which is stubbed here). Catches syntax/type errors in host and device code; it does not link
# or run anything. Usage: csrc/check_cuda.sh [sm_XY] (default sm_90).
set -euo pipefail
arch="${1:-sm_90}"
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
tinc="$("$python" -c 'import torch.utils.cpp_extension as c; print(c.include_paths()[0])')"
stub="$(mktemp -d)"
trap 'rm -rf "$stub"' EXIT
mkdir -p "$stub/c10/cuda/impl"
if [ ! -f "$tinc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$stub/c10/cuda/impl/cuda_cmake_macros.h"
fi
pids=()
for cu in "$root"/csrc/cuda/*.cu; do
  echo "nvcc -c $(basename "$cu") (${arch})"
  nvcc -c -std=c++20 -O3 --fmad=false -gencode "arch=compute_${arch#sm_},code=${arch}" \
    -I"$stub" -I"$tinc" -I"$tinc/torch/csrc/api/include" -D_GLIBCXX_USE_CXX11_ABI=1 \
    -Xcompiler -Wno-c++20-extensions "$cu" -o "$stub/$(basename "$cu").o" &
  pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
[ "$status" -eq 0 ] && echo "ok: csrc/cuda compiles" || { echo "FAILED: see errors above"; exit 1; }
