#!/bin/bash
# Many ranks on one GPU, one part per device call (each fits 10 minutes); logs and a summary in ${OUT:-out}/.
#   bash tests/run_gpu_scale.sh exits   a program on moe_ep.launch with the contract cases exits 0 with 8 ranks
#                                       sharing the GPU: tests/launch_program.py --contract, 10 runs
#   bash tests/run_gpu_scale.sh tools   the same for the README quick start (8 ranks, 3 runs), moe_ep.train
#                                       (8 ranks, 3 runs) and moe_ep.bench (2 ranks, one low-latency case)
#   bash tests/run_gpu_scale.sh 32      the contract checks with 32 ranks (4 nodes x 8): tests/test_gpu_scale.py
#   bash tests/run_gpu_scale.sh 48      the same with 48 ranks (6 nodes x 8), the most NVSHMEM runs on one GPU
#   bash tests/run_gpu_scale.sh 64      64 ranks on one GPU: every rank's native Buffer refused (ValueError)
# SKIP_BUILD=1 skips the install; LIMIT_S (default 580) bounds the 32/48-rank pytest run.
set -uo pipefail
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NVLS=1 \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
part=${1:?usage: bash tests/run_gpu_scale.sh exits|tools|32|48|64}
out=${OUT:-out}; mkdir -p "$out"
start=$SECONDS
if [ -z "${SKIP_BUILD:-}" ]; then  # SKIP_BUILD=1: moe_ep is already installed from this tree
  MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log"; exit 1; }
fi
echo "build $((SECONDS - start)) s" | tee -a "$out/summary.txt"

runs() {  # runs NAME COUNT LIMIT_S COMMAND...: COUNT runs, each rc and time to the summary; all logs in one file
  local name=$1 count=$2 limit=$3; shift 3
  local ok=0
  for i in $(seq "$count"); do
    local began=$SECONDS
    timeout "$limit" "$@" >>"$out/$name.log" 2>&1
    local rc=$?
    [ "$rc" = 0 ] && ok=$((ok + 1))
    echo "$name run $i | rc=$rc | $((SECONDS - began)) s" >>"$out/summary.txt"
  done
  echo "$name: exit 0 in $ok of $count runs" | tee -a "$out/summary.txt"
}

case $part in
  exits)
    runs launch_program 10 55 torchrun --standalone --nproc-per-node 8 tests/launch_program.py --contract
    grep -c "terminate called" "$out/launch_program.log" | sed 's/^/"terminate called" lines: /' >>"$out/summary.txt"
    grep -c "at exit: group destroyed, NVSHMEM down" "$out/launch_program.log" \
      | sed 's/^/ranks that left with the group destroyed and NVSHMEM finalized (of 80): /' >>"$out/summary.txt"
    ;;
  tools)
    python3 -c "import pathlib; from tests.test_readme import README, quick_start_code; \
pathlib.Path('$out/quickstart.py').write_text(quick_start_code(README.read_text()))"
    runs quickstart 3 90 torchrun --standalone --nproc-per-node 8 "$out/quickstart.py"
    runs train 3 90 torchrun --standalone --nproc-per-node 8 -m moe_ep.train --ranks-per-gpu 8 --steps 4 \
      --log-every 2 --no-progress
    runs bench 1 120 torchrun --standalone --nproc-per-node 2 -m moe_ep.bench --ranks-per-gpu 2 --cases l1 \
      --warmup 2 --iters 5 --out "$out/bench"
    grep -c "terminate called" "$out"/*.log | sed 's/^/"terminate called" lines: /' >>"$out/summary.txt"
    ;;
  64)
    began=$SECONDS
    MOE_EP_SCALE=1 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider \
      tests/test_gpu_scale.py::test_more_ranks_on_one_gpu_than_nvshmem_serves >"$out/scale_64.log" 2>&1
    rc=$?
    echo "EP64 on one GPU, refused on every rank | rc=$rc | $((SECONDS - began)) s | $(grep -E \
      '[0-9]+ (passed|failed|error|skipped)' "$out/scale_64.log" | tail -1)" >>"$out/summary.txt"
    ;;
  32|48)
    began=$SECONDS
    # host and GPU memory every 3 s: a rank that dies without a traceback (e.g. the OOM killer) shows there
    ( while :; do
        echo "$((SECONDS - began)) s | host used $(free -m | awk '/Mem:/{print $3}') MB, available" \
             "$(free -m | awk '/Mem:/{print $7}') MB | GPU used" \
             "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits) MB | $(pgrep -c python3) python3"
        sleep 3
      done ) >"$out/memory_$part.log" 2>&1 &
    monitor=$!
    MOE_EP_SCALE=1 timeout "${LIMIT_S:-580}" python3 -m pytest -q -s -rs -p no:cacheprovider \
      "tests/test_gpu_scale.py::test_many_ranks_on_one_gpu[$part]" >"$out/scale_$part.log" 2>&1
    rc=$?
    kill $monitor
    awk -F'host used ' '{split($2, a, " "); if (a[1] + 0 > most) {most = a[1] + 0; line = $0}} END {print line}' \
      "$out/memory_$part.log" | sed 's/^/memory at the most host use: /' >>"$out/summary.txt"
    grep "^EP$part" "$out/scale_$part.log" >>"$out/summary.txt"
    echo "EP$part on one GPU | rc=$rc | $((SECONDS - began)) s | $(grep -E '[0-9]+ (passed|failed|error)' \
      "$out/scale_$part.log" | tail -1)" >>"$out/summary.txt"
    ;;
  *) echo "unknown part $part: exits, tools, 32, 48 or 64"; exit 2 ;;
esac
cat "$out/summary.txt"
echo "total $((SECONDS - start)) s"
