#!/bin/bash
# One hash of everything moe_ep's native build reads (csrc/, setup.py, pyproject.toml, build_backend/): the
# prebuilt extensions (tests/prebuild_device_extensions.sh) serve a GPU run only while it is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
find csrc build_backend setup.py pyproject.toml -type f -not -path '*/__pycache__/*' | LC_ALL=C sort \
  | xargs sha1sum | sha1sum | cut -c1-40
