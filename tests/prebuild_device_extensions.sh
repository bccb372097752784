#!/bin/bash
# Build moe_ep's two native extensions here for the GPU machine (its Python, 3.12, and NVSHMEM, 3.4.5) into the
# git-ignored .carry/prebuilt/, so a GPU call skips its ~80 s build: tests/run_gpu_suite.sh puts them in place
# when the native sources are unchanged (tests/native_sources_hash.sh) and they load there, and builds as before
# otherwise. ~5 min on a 2-core machine; this checkout's own build and _build_info.json stay as they are.
# Usage: bash tests/prebuild_device_extensions.sh   (environment: DEVICE_PYTHON, a Python of the GPU machine's
#   version (python3.12); NVSHMEM_VERSION (3.4.5); MOE_EP_CUTLASS_DIR, else the headers that
#   tests/pack_device_carry.sh packed into .carry/cutlass_include.tar.xz; MAX_JOBS (2))
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"${DEVICE_PYTHON:-python3.12}" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q pybind11 ninja setuptools wheel "nvidia-nvshmem-cu13==${NVSHMEM_VERSION:-3.4.5}"
if [ -z "${MOE_EP_CUTLASS_DIR:-}" ]; then
  mkdir "$tmp/cutlass" && tar -C "$tmp/cutlass" -xJf .carry/cutlass_include.tar.xz
  export MOE_EP_CUTLASS_DIR="$tmp/cutlass"
fi
mkdir "$tmp/src" && git ls-files -z | tar --null -T - -cf - | tar -C "$tmp/src" -xf -  # the tracked files
(cd "$tmp/src" && MAX_JOBS=${MAX_JOBS:-2} "$tmp/venv/bin/pip" install -q --no-build-isolation --no-deps -e .)
rm -rf .carry/prebuilt && mkdir -p .carry/prebuilt
(cd "$tmp/src" && cp --parents moe_ep/comm/_C.cpython-*.so moe_ep/moe/_gemm.cpython-*.so moe_ep/comm/_build_info.json \
  "$root/.carry/prebuilt/")
bash "$tmp/src/tests/native_sources_hash.sh" >.carry/prebuilt/SOURCES  # the sources built: the copy
find .carry/prebuilt -type f | xargs ls -l
