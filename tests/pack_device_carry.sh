#!/bin/bash
# Pack what a GPU run needs but the GPU machine cannot download (it has no network) into the git-ignored
# .carry/, as two xz tarballs that tests/run_gpu_suite.sh unpacks there: CUTLASS's headers from the
# nvidia-cutlass wheel (the FP8 grouped GEMMs, csrc/gemm/) and the frameworks folder for the GPU machine's
# Python (tests/fetch_frameworks.py). Unpacked they are ~87 MiB, over the device tool's 64 MiB carry with the
# tree; packed ~13 MiB: name ".carry" in the call's carry.
# Usage: bash tests/pack_device_carry.sh   (environment: CUTLASS_VERSION (4.2.0.0), PYTHON_VERSION (3.12))
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p .carry
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "nvidia-cutlass==${CUTLASS_VERSION:-4.2.0.0}"
python3 -m zipfile -e "$tmp"/nvidia_cutlass-*.whl "$tmp/cutlass"
tar -C "$tmp/cutlass/cutlass_library/source" -cJf .carry/cutlass_include.tar.xz include
python3 tests/fetch_frameworks.py --python-version "${PYTHON_VERSION:-3.12}" --leave-out tokenizers safetensors \
  --out "$tmp/frameworks"
tar -C "$tmp/frameworks" -cf - . | xz -T0 -6 >.carry/frameworks.tar.xz
ls -l .carry/cutlass_include.tar.xz .carry/frameworks.tar.xz
