// Shared device-side toolkit for every moe_ep kernel: the Comm argument block, the signal-slot map,
// release/acquire flag helpers at system scope, and waits that time out and report rank + phase.
//
// Signals: every rank owns one symmetric uint64 array `signals` of kNumSignalSlots * kMaxNodeRanks
// entries. Entry [slot * kMaxNodeRanks + src] on rank `dst` is written only by rank `src`, only for
// `slot`. Values are epochs (1, 2, 3, ...) that only grow, so nothing is ever reset and a waiter
// waits for `flag >= epoch`. Epochs live in device memory (Comm::epochs, one counter per slot
// group), not on the host, so a captured CUDA graph replays with fresh epochs.
//
// Network leg (ranks in other nodes, reached only through NVSHMEM device operations): data moves by
// nvshmem puts, and a peer learns of it through a uint64 signal word in its own symmetric memory,
// updated by put-with-signal or by nvshmemx_signal_op after nvshmem_fence. NVSHMEM guarantees that a
// put-with-signal's data is delivered before its signal, and that nvshmem_fence orders the calling
// thread's puts and signal ops to one PE; wait_signal_geq below observes the signal with
// nvshmem_signal_fetch. Nothing on the network leg relies on NVLink's store order.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "runtime/error_code.h"
#include "runtime/limits.h"

namespace moe_ep {


// Signal slots (index into the per-rank signal array, times kMaxNodeRanks, plus source rank).
enum SignalSlot : int {
  kSigNotify = 0,         // intranode: count exchange (also the dispatch start barrier)
  kSigDispatchReady = 1,  // intranode: cached-dispatch start barrier
  kSigDispatchDone = 2,   // intranode: epoch counter only (numbers the per-row flags)
  kSigCombineReady = 3,   // intranode: combine start barrier
  kSigCombineDone = 4,    // intranode: epoch counter only (numbers the per-row flags)
  kSigLowLatencyFirst = 8,  // 8..15 belong to the low-latency kernels
  kNumSignalSlots = 16,
};

// Epoch counters (device memory, uint64 each), one per protocol; same indices as the slots.
constexpr int kNumEpochs = kNumSignalSlots;

// Phases, named in timeout errors. Keep kPhaseNames in sync (used by the bindings).
enum Phase : int {
  kPhaseNone = 0,
  kPhaseNotify = 1,            // dispatch: waiting for a peer's token counts
  kPhaseDispatchBarrier = 2,   // dispatch: waiting for a peer to be ready to receive
  kPhaseDispatchRecv = 3,      // dispatch: waiting for a peer's rows to land
  kPhaseCombineBarrier = 4,    // combine: waiting for a peer to be ready to receive
  kPhaseCombineRecv = 5,       // combine: waiting for a peer's rows to land
  kPhaseLowLatencyDispatchRecv = 6,  // low-latency dispatch: waiting for a peer's rows/counts
  kPhaseLowLatencyCombineRecv = 7,   // low-latency combine: waiting for a peer's rows
  kPhaseLowLatencyBarrier = 8,       // low-latency: waiting for a peer to free its buffers
  kPhaseNodeNotify = 9,              // cross-node dispatch: waiting for a peer's token counts
  kPhaseNodeSendCredit = 10,         // cross-node dispatch: waiting for a remote forwarder to free a buffer
  kPhaseNodeForwardRecv = 11,        // cross-node dispatch: forwarder waiting for a remote node's rows
  kPhaseNodeForwardCredit = 12,      // cross-node dispatch: forwarder waiting for a local rank to free a buffer
  kPhaseNodeDispatchRecv = 13,       // cross-node dispatch: waiting for a forwarder's rows
  kPhaseNodeCombineGather = 14,      // cross-node combine: forwarder waiting for a local rank's rows
  kPhaseNodeCombineCredit = 15,      // cross-node combine: waiting for a rank to free a buffer
  kPhaseNodeCombineRecv = 16,        // cross-node combine: waiting for a node's partial sums
  kPhaseNodeStart = 17,              // cross-node: waiting for a peer to finish its previous call
  kPhaseLowLatencyCombineWaitCompute = 18,  // low-latency combine: waiting for this rank's GEMM to signal comp_signal
  kPhaseCallStamp = 19,              // every call: waiting for a peer's call stamp (the peer has not made this call)
  kNumPhases = 20,
};


// Lives in host-mapped memory so the host reads it without a device sync (moe_ep/comm/errors.py mirrors
// the fields, checked field by field against error_state_fields()). The code part is written once, by
// the first wait that times out or by a stamp exchange that finds the ranks' calls differ, and every
// other waiting thread sees `code != 0` and gives up too; after a mismatch the call's other kernels do
// nothing at all (block_stamps_disagreed). The bad-id part is written once by the first thread that reads an
// expert id outside [-1, E) from topk_idx: the kernels then treat that entry as -1, so the call's
// protocol still completes on every rank, and the host raises ValueError.
struct ErrorState {
  int code;        // ErrorCode
  int rank;        // the rank that recorded it
  int phase;       // Phase
  int peer;        // the rank it was waiting for, or whose stamp differs
  int stamp_slot;  // kErrorMismatch: the slot of the stamp table that holds every rank's stamp
  int bad_claim;  // 1 once a thread claimed the bad-id record (it fills the fields below, then bad_id)
  int bad_id;     // 1 once bad_token / bad_k / bad_value are complete
  int bad_token;  // token (row of topk_idx) and entry k of the first bad id seen
  int bad_k;
  long long bad_value;
};

// Everything a kernel needs to talk to its peers. Built once per Buffer on the host.
struct Comm {
  int rank;
  int nranks;
  unsigned long long timeout_ns;
  ErrorState* error;               // device address of the host-mapped ErrorState
  const int* verdict;              // device memory: the call's stamp verdict (block_stamps_disagreed)
  unsigned long long* epochs;      // device-local counters [kNumEpochs]
  int* masked;                     // low-latency fault-tolerant mode: int[nranks] in device memory, 1 for a
                                   // rank that missed a timeout (its waits are skipped); nullptr otherwise
  uint64_t* signals[kMaxNodeRanks];    // each rank's signal array, as addressed from this GPU
};

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Acquire load at system scope: pairs with st_release_sys / red_release_sys on a peer GPU, so all
// of that peer's writes before its release are visible to this thread after the load.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Address of the flag that rank `src` writes at rank `dst` for `slot`.
__device__ __forceinline__ uint64_t* signal_at(const Comm& c, int dst, int slot, int src) {
  return c.signals[dst] + slot * kMaxNodeRanks + src;
}

__device__ __forceinline__ bool comm_aborted(const Comm& c) {
  return *reinterpret_cast<volatile int*>(&c.error->code) != 0;
}

// Whether this call's stamp exchange (kernels/call_check/stamp_exchange.cu, the call's first kernel on the
// same stream) found that the ranks make different calls: then every kernel of the call returns at once,
// in every block, before it writes anything, on every rank (each rank's exchange saw every stamp), so no
// epoch, counter or flag moves and the next call finds the ranks in step. A timeout (kErrorTimeout)
// does not skip: those kernels give up in their waits and keep their epochs in step as before.
__device__ __forceinline__ bool stamps_disagreed(const ErrorState* error) {
  return *reinterpret_cast<const volatile int*>(&error->code) == kErrorMismatch;
}

// stamps_disagreed for a whole block, called by all of its threads at the top of a kernel. ErrorState is
// host-mapped, read over the bus, uncached, ~1.1 us a read: one per thread cost ~4.6 ms per low-latency
// kernel (256 blocks x 512 threads), one per block ~280 us (bench/results/h100_2026-12-05_session8_gpu_runs.md).
// So the call's stamp exchange, the earlier kernel on the same stream, leaves stamps_disagreed's answer in
// Comm::verdict (device memory; stream order makes it visible here), and thread 0 reads that word; only
// where it says 1 does thread 0 read ErrorState too, since the host may have raised and cleared the
// mismatch since (a low-latency receive half launched after a later call's mismatch raised): the answer is
// stamps_disagreed's in every case, one device-memory load in the common one. The block shares it.
__device__ __forceinline__ bool block_stamps_disagreed(const Comm& c) {
  __shared__ int disagreed;
  if (threadIdx.x == 0)
    disagreed = *reinterpret_cast<const volatile int*>(c.verdict) != 0 && stamps_disagreed(c.error) ? 1 : 0;
  __syncthreads();
  return disagreed != 0;
}

// Whether `peer` is masked (fault-tolerant mode only). A plain volatile load: other blocks of the same
// kernel may mask a peer while this thread waits.
__device__ __forceinline__ bool peer_masked(const Comm& c, int peer) {
  return c.masked != nullptr && *reinterpret_cast<volatile int*>(c.masked + peer) != 0;
}

// An expert id read from topk_idx: v when it lies in [0, E), else -1. A value outside [-1, E) is
// recorded (the first one wins; ErrorState) so the host raises ValueError naming token and value.
// error == nullptr: a kernel that reads ids an earlier kernel of the same call already checked
// (normal-mode dispatch after notify / route) maps them without recording, so no record can land
// after the host read the call's errors and be raised by a later call.
__device__ __forceinline__ int checked_expert(ErrorState* error, long long v, int num_experts, int token, int k) {
  if (v >= 0 && v < num_experts) return static_cast<int>(v);
  if (v != -1 && error != nullptr && atomicCAS_system(&error->bad_claim, 0, 1) == 0) {
    error->bad_token = token;
    error->bad_k = k;
    error->bad_value = v;
    __threadfence_system();
    atomicExch_system(&error->bad_id, 1);
  }
  return -1;
}

// Eight bf16 NaNs (0x7fc0) in one int4: written over the output rows of a call whose wait gave up, so
// nothing downstream mistakes them for results.
__device__ __forceinline__ int4 bf16_nan_x8() { return make_int4(0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0); }
// Sixteen e4m3 NaNs (0x7f) in one int4: the same poison over FP8 rows.
__device__ __forceinline__ int4 e4m3_nan_x16() { return make_int4(0x7f7f7f7f, 0x7f7f7f7f, 0x7f7f7f7f, 0x7f7f7f7f); }
// The float32 NaN written over the combined weights of such a call.
__device__ __forceinline__ float f32_nan() { return __int_as_float(0x7fc00000); }

__device__ __forceinline__ void report_timeout(const Comm& c, int phase, int peer) {
  if (atomicCAS_system(&c.error->code, kErrorNone, kErrorTimeout) == kErrorNone) {
    c.error->rank = c.rank;
    c.error->phase = phase;
    c.error->peer = peer;
    __threadfence_system();
  }
}

// Relaxed system-scope accesses and the fence that orders them. Polling with relaxed loads costs
// no L1 invalidation per spin (unlike ld.acquire); relaxed load + fence.acq_rel.sys is an acquire
// pattern and fence.acq_rel.sys + relaxed store/add a release pattern, so one fence can serve a
// whole batch of flags. fence.acq_rel is enough: flags need no single total order (fence.sc, as in
// __threadfence_system, is the costly kind).
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_add_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// A wait gave up: the timeout passed (or another thread already gave up). Without a mask this
// records the timeout once (ErrorState) and the call aborts; in fault-tolerant mode it masks `peer`
// instead (every later wait for it returns at once) and the call goes on without that peer.
__device__ __forceinline__ void give_up(const Comm& c, int phase, int peer) {
  if (c.masked != nullptr)
    atomicExch(c.masked + peer, 1);
  else
    report_timeout(c, phase, peer);
}

// Whether a wait for `peer` started at `start` must stop: the call aborted, the peer is masked, or the
// timeout passed (then give_up records or masks it).
__device__ __forceinline__ bool stop_waiting(const Comm& c, uint64_t start, int phase, int peer) {
  if (comm_aborted(c) || peer_masked(c, peer)) return true;
  if (global_timer_ns() - start <= c.timeout_ns) return false;
  give_up(c, phase, peer);
  return true;
}

// Spin (relaxed loads) until *flag >= target. Returns false when stop_waiting says so; callers then
// leave the kernel without hanging (or, in fault-tolerant mode, skip a masked peer). A masked peer
// returns false at once. Gives no ordering: the caller fences (acquire) after a true return.
__device__ __forceinline__ bool wait_relaxed_geq(const Comm& c, const uint64_t* flag, uint64_t target, int phase,
                                                 int peer) {
  if (ld_relaxed_sys(flag) >= target) return !peer_masked(c, peer);
  if (peer_masked(c, peer)) return false;
  const uint64_t start = global_timer_ns();
  for (uint32_t spin = 1;; ++spin) {
    if (ld_relaxed_sys(flag) >= target) return true;
    if ((spin & 1023u) == 0 && stop_waiting(c, start, phase, peer)) return false;
  }
}

// wait_relaxed_geq, then one acquire load: the writer's stores before its release are visible to
// this thread afterwards (flags only grow, so the acquire load still sees a value >= target).
__device__ __forceinline__ bool wait_geq(const Comm& c, const uint64_t* flag, uint64_t target, int phase, int peer) {
  return wait_relaxed_geq(c, flag, target, phase, peer) && ld_acquire_sys(flag) >= target;
}

// Network leg: spin until the NVSHMEM signal word `sig` (this rank's symmetric memory, updated by a
// peer's put-with-signal or signal op) is >= target, with the same timeout and abort rules as
// wait_relaxed_geq. On true, a fence.acq_rel.sys after the observing fetch orders this thread's
// later loads after it, so the data NVSHMEM delivered before the signal is visible to them.
__device__ __forceinline__ bool wait_signal_geq(const Comm& c, uint64_t* sig, uint64_t target, int phase, int peer) {
  if (peer_masked(c, peer)) return false;
  if (nvshmem_signal_fetch(sig) < target) {
    const uint64_t start = global_timer_ns();
    for (uint32_t spin = 1; nvshmem_signal_fetch(sig) < target; ++spin)
      if ((spin & 1023u) == 0 && stop_waiting(c, start, phase, peer)) return false;
  }
  fence_acq_rel_sys();
  return true;
}

}  // namespace moe_ep
