#!/usr/bin/env bash
# Downloads, here (with network), the Python 3.12 wheels the GPU machine lacks into .whl/, so that
# scripts/gpu_check.sh can install them there with no network (pip --no-index --target):
#   megatron-core 0.16.1 (cp312 manylinux), omegaconf 2.4.0 (needs only PyYAML; 2.3 would need
#   the sdist-only antlr4 runtime), PyYAML (cp312 manylinux) and packaging (megatron imports it),
#   plus hybridrl's other install_requires a CUDA torch image may lack: pyarrow (the parquet
#   data path of the PPO step) and safetensors.
# numpy is not fetched: the GPU machine's own (its tests already use it) stays in charge.
# Fails when the total exceeds 64 MiB (what the device tool carries). Usage, repository root:
#   scripts/gpu_wheels.sh     # .whl/ is git-ignored: pass it with the device tool's carry=[".whl"]
set -euo pipefail
py="${PYTHON:-.venv/bin/python}"
dest=".whl"
rm -rf "$dest"
mkdir -p "$dest"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d "$dest" megatron-core==0.16.1 omegaconf==2.4.0 "PyYAML>=6" "packaging>=23" \
  "pyarrow>=14" "safetensors>=0.4"
ls -l "$dest"
total=$(du -sb "$dest" | cut -f1)
echo "total $((total / 1024)) KiB in $dest"
if [ "$total" -gt $((64 * 1024 * 1024)) ]; then
  echo "error: $dest holds more than 64 MiB" >&2
  exit 1
fi
for w in megatron_core omegaconf; do
  compgen -G "$dest/${w}-*.whl" >/dev/null || { echo "error: no $w wheel" >&2; exit 1; }
done
