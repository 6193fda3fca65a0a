#!/usr/bin/env bash
# Downloads, here (with network), the only Python packages hybridrl needs that the GPU machine's
# image lacks, as Python 3.12 wheels into .whl/, so scripts/gpu_check.py (stage env) installs them
# there with no network (pip --no-index --no-deps --target /tmp/site):
#   megatron-core 0.16.1 (cp312 manylinux; needs numpy, packaging, torch: all on the image)
#   omegaconf 2.4.0      (pure Python; needs PyYAML, on the image; 2.3 would need antlr4's sdist)
# Everything else hybridrl imports (torch, numpy, pyarrow, safetensors, PyYAML, packaging,
# transformers, pytest) is on the image (the device tool's KINDS.md lists its packages), so it is
# not carried. Both pins match setup.py. Fails when a wheel is missing or .whl/ exceeds 8 MiB.
# Usage, repository root (.whl/ must be git-ignored; pass it with the device tool's carry):
#   echo /.whl/ >> .git/info/exclude; bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-.venv/bin/python}"
dest=".whl"
pins=(megatron-core==0.16.1 omegaconf==2.4.0)
rm -rf "$dest"
mkdir -p "$dest"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d "$dest" "${pins[@]}"
ls -l "$dest"
for w in megatron_core-0.16.1 omegaconf-2.4.0; do
  compgen -G "$dest/${w}-*.whl" >/dev/null || { echo "error: no $w wheel in $dest" >&2; exit 1; }
done
count=$(find "$dest" -type f -name '*.whl' | wc -l)
[ "$count" -eq "${#pins[@]}" ] || { echo "error: $count wheels, expected ${#pins[@]}" >&2; exit 1; }
total=$(du -sb "$dest" | cut -f1)
echo "total $((total / 1024)) KiB in $dest (${#pins[@]} wheels)"
if [ "$total" -gt $((8 * 1024 * 1024)) ]; then
  echo "error: $dest holds more than 8 MiB: only megatron-core and omegaconf belong there" >&2
  exit 1
fi
