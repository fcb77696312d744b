#!/usr/bin/env bash
# Run HERE (a machine with network) before the device check: download into .whl/ the wheels the
# GPU machine lacks (it has no network; Python 3.12, torch 2.11, numpy, xxhash, safetensors,
# pytest, pytest-xdist, pytest-timeout, hypothesis are there). .whl/ is ignored by git and
# travels with `carry: [".whl"]`.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  zstandard==0.23.0 jsonschema==4.23.0 jsonschema-specifications==2024.10.1 \
  referencing==0.35.1 rpds-py==0.22.3
ls -la .whl
