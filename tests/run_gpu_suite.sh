#!/bin/bash
# The GPU tests on whatever GPUs are present (ranks share them when fewer: tests/_dist.py), as three
# parallel lanes so the suite fits a 10-minute device call; one log per lane and a summary table in
# ${OUT:-out}/ (at most 8 files, as the device tool returns). Usage: bash tests/run_gpu_suite.sh
# (WITH_LAYER_BENCH=1: then the one-rank layer benchmark, alone, into $OUT/bench/)
set -uo pipefail
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NVLS=1 \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
out=${OUT:-out}; mkdir -p "$out"
start=$SECONDS
MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 \
  || { tail -30 "$out/build.log"; exit 1; }
echo "build $((SECONDS - start)) s"
lane() {  # lane NAME "test selection@time limit in s" ...
  local name=$1; shift
  for spec in "$@"; do
    local sel=${spec%@*} limit=${spec##*@} began=$SECONDS
    # shellcheck disable=SC2086
    timeout "$limit" python3 -m pytest -q -rs -p no:cacheprovider $sel >"$out/$name.part" 2>&1
    local rc=$?
    cat "$out/$name.part" >>"$out/$name.log"
    echo "$sel | rc=$rc | $((SECONDS - began)) s | $(grep -E '[0-9]+ (passed|failed|error)' "$out/$name.part" | tail -1)" \
      >>"$out/summary.txt"
  done
  rm -f "$out/$name.part"
}
lane A tests/test_gpu_fuzz.py@420 "tests/test_fp8_experts.py -k gpu@90" "tests/test_expert_major.py -k gpu@90" &
lane B tests/test_gpu_intranode.py@220 tests/test_gpu_low_latency.py@80 tests/test_gpu_crossnode.py@150 \
  "tests/test_overlap.py -k gpu@150" &
lane C tests/test_gpu_faults.py@130 "tests/test_layer.py -k gpu@90" "tests/test_deep_ep.py -k gpu@60" \
  "tests/test_compile.py -k gpu@120" "tests/test_one_rank_bad_input.py -k gpu@60" "tests/test_train.py -k gpu@70" \
  tests/test_gpu_runtime.py@40 tests/test_gpu_determinism.py@90 tests/test_gpu_config.py@60 &
lane D "tests/test_streaming.py -k native@420" &
wait
began=$SECONDS
timeout 60 torchrun --nproc-per-node 4 -m moe_ep.train --ranks-per-gpu 4 --steps 20 --log-every 10 --no-progress \
  >"$out/train.log" 2>&1
echo "torchrun moe_ep.train, 4 ranks | rc=$? | $((SECONDS - began)) s | $(grep done "$out/train.log")" >>"$out/summary.txt"
if [ -n "${WITH_LAYER_BENCH:-}" ]; then  # alone after the tests, so its compute numbers are valid (one rank)
  began=$SECONDS
  timeout 150 torchrun --nproc-per-node 1 -m moe_ep.bench --cases layer --layer-experts 128 --warmup 5 --iters 20 \
    --out "$out/bench" 2>&1 | grep -v Warning >"$out/bench.txt"  # table to the summary: 8 files in all
  echo "moe_ep.bench --cases layer, 1 rank | rc=${PIPESTATUS[0]} | $((SECONDS - began)) s" >>"$out/summary.txt"
  grep -E "^(#|config|case|-|layer|decode|not shown|no FP8|%hidden)" "$out/bench.txt" >>"$out/summary.txt"
  rm -f "$out/bench.txt"
fi
cat "$out/summary.txt"
echo "total $((SECONDS - start)) s"
