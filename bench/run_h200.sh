#!/bin/bash
# Build, check and benchmark moe_ep on the 2xH200 machine in one go; logs land in ${OUT:-out}/.
# Usage: bash bench/run_h200.sh [stage ...]   stages: build info tests bench train (default: all)
set -uo pipefail
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NVLS=1 \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
out=${OUT:-out}; mkdir -p "$out"
stages=${*:-build info tests bench train}
has() { [[ " $stages " == *" $1 "* ]]; }
if has build; then
  python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 || { tail -60 "$out/build.log"; exit 1; }
  echo "build ok"
fi
has info && python3 -m moe_ep.info 2>&1 | tee "$out/info.txt"
has tests && timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -rs ${TESTS:-tests} 2>&1 | tee "$out/tests.log" | tail -40
has bench && timeout ${BENCH_TIMEOUT:-300} torchrun --nproc-per-node 2 -m moe_ep.bench --out "$out" ${BENCH_ARGS:-} 2>&1 \
  | grep -v "^W1" | tee "$out/bench.log" | tail -40
has train && timeout 240 torchrun --nproc-per-node 2 -m moe_ep.train ${TRAIN_ARGS:-} 2>&1 | tee "$out/train.log" | tail -15
exit 0
