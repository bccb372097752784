#!/bin/bash
# Every test marked `gpu` (one list, collected with `pytest -m gpu`, so a new GPU test cannot be left
# out), on whatever GPUs are present (ranks share them when fewer: tests/_dist.py), in parallel lanes
# (several pytest processes sharing the GPU) so the suite fits a 10-minute device call; then a 4-rank
# torchrun of moe_ep.train. Exits non-zero when the build or collection fails, nothing is collected,
# or any file fails or times out. Every lane's log in one file (lanes.log) and a summary table in
# ${OUT:-out}/ (at most 8 files, as the device tool returns).
# Usage: bash tests/run_gpu_suite.sh [PATH...]   (PATHs: where to collect, default tests/; e.g.
#   `bash tests/run_gpu_suite.sh tests/test_fp8.py tests/test_my_failing.py` for a quick check)
# Environment: LANES (default 7), BUDGET_S (seconds for all lanes, default 520; each file also has
#   its own limit, below), STAGGER_S (default 4: lane n starts its first unit (n - 1) x STAGGER_S seconds in,
#   the torchrun after the last, so the processes' NVSHMEM starts do not all fall in the same seconds), SKIP_BUILD=1,
#   NO_TRAIN=1 (skip the torchrun), WITH_LAYER_BENCH=1 (then the one-rank layer bench, alone, into $OUT/bench/).
#   With .carry/prebuilt/ (tests/prebuild_device_extensions.sh) its extensions replace the build where they fit.
set -uo pipefail
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NVLS=1 \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
out=${OUT:-out}; mkdir -p "$out"; : >"$out/summary.txt"
# What tests/pack_device_carry.sh packed into .carry/ (this machine may have no network): the frameworks folder,
# unless .frameworks exists, and (below, for a build only) CUTLASS's headers, unless $MOE_EP_CUTLASS_DIR names some.
if [ -f .carry/frameworks.tar.xz ] && [ ! -d .frameworks ]; then
  mkdir .frameworks && tar -C .frameworks -xJf .carry/frameworks.tar.xz
fi
logs=$(mktemp -d)  # one log per lane, joined into $out/lanes.log as each lane ends (at most 8 files come back)
start=$SECONDS
lanes=${LANES:-7} budget=${BUDGET_S:-520} stagger=${STAGGER_S:-4}
# Extensions built on the dev machine for this one (tests/prebuild_device_extensions.sh): in place of the build
# below when the native sources are the ones they were built from and they load here. What the build's editable
# installs give stays the same: moe_ep importable from any folder (a .pth file naming this one) and the
# pure-Python deep_ep package installed.
if [ -z "${SKIP_BUILD:-}" ] && [ -f .carry/prebuilt/SOURCES ] \
   && [ "$(bash tests/native_sources_hash.sh)" = "$(cat .carry/prebuilt/SOURCES)" ]; then
  cp -r .carry/prebuilt/moe_ep .
  if python3 -c "from moe_ep.comm import _native; _native.load(); import moe_ep.moe._gemm" >"$out/build.log" 2>&1 \
     && python3 -m pip install --no-build-isolation --no-deps -e ./deep_ep_compat >>"$out/build.log" 2>&1 \
     && python3 -c "import pathlib, site, sys; pathlib.Path(site.getsitepackages()[0], 'moe_ep_prebuilt.pth').write_text(sys.argv[1])" \
          "$PWD" >>"$out/build.log" 2>&1; then
    SKIP_BUILD=1; echo "prebuilt extensions in place ($((SECONDS - start)) s)"
  else
    tail -5 "$out/build.log"; echo "prebuilt extensions did not load: building"
  fi
fi
if [ -z "${SKIP_BUILD:-}" ]; then
  if [ -f .carry/cutlass_include.tar.xz ] && [ -z "${MOE_EP_CUTLASS_DIR:-}" ]; then
    export MOE_EP_CUTLASS_DIR=${TMPDIR:-/tmp}/moe_ep_cutlass
    mkdir -p "$MOE_EP_CUTLASS_DIR" && tar -C "$MOE_EP_CUTLASS_DIR" -xJf .carry/cutlass_include.tar.xz
  fi
  # with the optional deep_ep package (deep_ep_compat/), which the framework tests import
  MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install --no-build-isolation --no-deps -e . -e ./deep_ep_compat \
    >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  echo "build $((SECONDS - start)) s"
fi

# The GPU tests, grouped per file. requires_gpus() marks a test `gpu` only where a GPU and the native
# module are present (else it skips), so collecting nothing here means this machine cannot run them.
collected=$(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider "${@:-tests}" 2>&1)
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then echo "$collected" | tail -30; echo "collection failed (rc=$rc)"; exit 1; fi
files=$(echo "$collected" | grep '::' | sed 's/::.*//' | sort -u)
if [ -z "$files" ]; then  # pytest's rc 5
  echo "no test marked gpu collected (no GPU, or moe_ep.comm._C not built?)"; exit 1
fi
echo "$collected" | grep -c '::' | xargs echo "GPU tests collected:"

# Lanes by longest unit first, each unit to the lane with the least work so far. A unit is a file, or one
# test of a file that would take over 150 s (so its tests can run in parallel lanes; each pytest start
# costs about 10 s). Seconds per file (a split file: the sum of its units): one H100, 7 lanes, the whole suite on
# 2026-12-07 (bench/results/h100_2026-12-07_session23_gpu_run.md; test_router and test_gpu_intranode's off-stream
# part from session 24's run); a file not listed counts 60 s. Prints one line per lane
# of UNIT@LIMIT: each unit may take 2.5 x its seconds (at least 60 s), so a hang cannot starve its lane.
plan_file=$(mktemp)
# shellcheck disable=SC2046
python3 - "$lanes" "$stagger" $(echo "$collected" | grep '::') >"$plan_file" <<'EOF'
import sys
from collections import defaultdict
secs = {"test_gpu_intranode.py": 290, "test_gpu_crossnode.py": 242, "test_gpu_faults.py": 227, "test_nvfp4.py": 163,
        "test_gpu_low_latency.py": 189, "test_fp8_experts.py": 171, "test_overlap.py": 149, "test_bench.py": 144,
        "test_gpu_fuzz.py": 124, "test_streaming.py": 118, "test_frameworks_hybrid.py": 118,
        "test_gpu_low_latency_deepep.py": 113, "test_compile.py": 110, "test_train.py": 100, "test_deep_ep.py": 90,
        "test_expert_major.py": 68, "test_one_rank_bad_input.py": 64, "test_gpu_config.py": 58, "test_frameworks_v2.py": 55,
        "test_fp8_wgrad.py": 55, "test_fp8_grouped_gemm_sm90.py": 51, "test_low_latency_overlap.py": 41,
        "test_gpu_determinism.py": 37, "test_hybrid_ep.py": 27, "test_layer.py": 25, "test_router.py": 25,
        "test_split_gate.py": 20, "test_deep_ep_v2.py": 17, "test_timeline.py": 15, "test_gpu_runtime.py": 12,
        "test_experts.py": 12, "test_fp8.py": 9, "test_gpu_scale.py": 8, "test_frameworks_low_latency.py": 6}
SPLIT, START = 150, 10
lanes, stagger = int(sys.argv[1]), int(sys.argv[2])
tests = defaultdict(list)
for node in sys.argv[3:]:
    tests[node.split("::")[0]].append(node)
units = []  # (unit, seconds)
for f, ids in tests.items():
    t = secs.get(f.split("/")[-1], 60)
    if t > SPLIT and len(ids) > 1:
        units += [(node, t / len(ids) + START) for node in ids]
    else:
        units.append((f, t))
work, plan = [float(i * stagger) for i in range(lanes)], [[] for _ in range(lanes)]  # a lane's late start
for unit, t in sorted(units, key=lambda u: -u[1]):
    i = work.index(min(work))
    work[i] += t
    plan[i].append(f"{unit}@{max(60, int(2.5 * t))}")
print("\n".join(" ".join(p) for p in plan if p))
EOF
units=$(grep -o '@' "$plan_file" | wc -l)
deadline=$((SECONDS + budget))
lane() {  # lane N FILE@LIMIT...: each file's GPU tests, within its limit and the budget
  local name=lane$1; sleep $(( ($1 - 1) * stagger )); shift
  for spec in "$@"; do
    local file=${spec%@*} limit=${spec##*@} began=$SECONDS left=$((deadline - SECONDS))
    [ $left -lt 10 ] && left=10
    [ $limit -gt $left ] && limit=$left
    # SIGINT first: pytest reports the test it was in, and tests/_dist.py prints the ranks' stacks
    MOE_EP_TEST_STACKS="$logs/$name.stacks" timeout -s INT -k 20 "$limit" \
      python3 -m pytest -q -rs -p no:cacheprovider -m gpu "$file" >"$logs/$name.part" 2>&1
    local rc=$?
    cat "$logs/$name.part" >>"$logs/$name.log"
    if [ -s "$logs/$name.stacks" ]; then echo "--- stacks of ranks that did not finish:"; cat "$logs/$name.stacks"; fi >>"$logs/$name.log"
    rm -f "$logs/$name.stacks"
    local result; result=$(grep -E '[0-9]+ (passed|failed|error|skipped)' "$logs/$name.part" | tail -1)
    { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && result="TIMED OUT after $((SECONDS - began)) s (limit ${limit} s)"
    echo "$file | rc=$rc | $((SECONDS - began)) s | $result" >>"$out/summary.txt"
  done
  rm -f "$logs/$name.part"
  { echo "===== $name"; cat "$logs/$name.log"; } >>"$out/lanes.log"  # whole lanes, one after another
}
train() {  # the 4-rank torchrun, beside the lanes (it waits on peers like they do), after their starts
  sleep $(( lanes * stagger ))
  local began=$SECONDS
  timeout 240 torchrun --standalone --nproc-per-node 4 -m moe_ep.train --ranks-per-gpu 4 --steps 20 --log-every 10 --no-progress \
    >"$out/train.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] && ! grep -q "(4 ranks per GPU)" "$out/train.log" && rc=1  # --ranks-per-gpu took effect
  echo "torchrun moe_ep.train, 4 ranks | rc=$rc | $((SECONDS - began)) s | $(grep done "$out/train.log")" >>"$out/summary.txt"
}
# The GPU's memory in use, every 2 s while the tests run: its peak goes into the summary (what lanes cost).
memlog=$logs/memory.csv
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits -l 2 >"$memlog" 2>/dev/null &
sampler=$!
pids=()
[ -z "${NO_TRAIN:-}" ] && { train & pids+=($!); }
n=0
set -f  # units such as tests/test_overlap.py::test_overlap_gpu[ep2] are not glob patterns
while read -r line; do
  n=$((n + 1))
  # shellcheck disable=SC2086
  lane "$n" $line &
  pids+=($!)
done <"$plan_file"
wait "${pids[@]}"
kill "$sampler" 2>/dev/null
awk -F', ' 'NF == 2 && $1 + 0 > peak { peak = $1 + 0; total = $2 } END { if (peak) print "GPU memory in use, peak of 2 s samples: " peak " of " total " MiB" }' \
  "$memlog" >>"$out/summary.txt"
rm -f "$plan_file"
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
ran=$(grep -c ' | rc=' "$out/summary.txt")
failed=$(grep ' | rc=' "$out/summary.txt" | grep -vc ' | rc=0 |')
expected=$units
[ -z "${NO_TRAIN:-}" ] && expected=$((expected + 1))
[ -n "${WITH_LAYER_BENCH:-}" ] && expected=$((expected + 1))
if [ "$failed" -ne 0 ] || [ "$ran" -lt "$expected" ]; then
  echo "FAILED: $failed of $ran runs failed or timed out ($expected expected)"
  exit 1
fi
echo "PASSED: all $ran runs"
