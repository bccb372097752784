// Normal-mode (training / prefill) dispatch and combine over NVLink: host-side parameters, the
// symmetric workspace layout and the kernel launchers.
//
// The first part is plain C++ (no device code, no comm.h) so that intranode_bindings.cpp compiles
// with the host compiler; the part under __CUDACC__ holds the device code shared by layout.cu,
// notify.cu, dispatch.cu and combine.cu.
//
// Symmetric memory of a Buffer besides its comm.h signal array: two allocations with the same layout
// on every rank. "Slot s" of a region on rank d holds what rank s wrote there; only rank s writes it.
// Workspace (WorkspaceLayout):
//   counts    [2][R][count_stride]     int32; set [notify epoch % 2], row s: tokens s sends to d, then
//                                      d's E_l local experts' token counts among them (notify.cu)
//   data      [R][T][2H bytes]         dispatch: the rows s sends to d, at the position of each token
//                                      among s's tokens for d (so slot s is already in final order),
//                                      packed at the row size (2H bf16, H e4m3); combine: bf16 rows
//                                      [T][H] that s returns to d, at d's original token index
//   topk      [R][T][K] int64          dispatch metadata, same positions as the rows: topk_idx as
//   weights   [R][T][K] float32        local expert ids of d (-1 elsewhere) and weights (0 there),
//   src_index [R][T] int32             the source token index,
//   scales    [R][T][H/128] float32    FP8 scales. A combine with weights uses `weights` too: row i
//                                      of slot s holds the K weights s returns with its row i
// Row flags, uint64 [2][R][T]: [0][s][p] is raised by source s once dispatch row p of slot s (and its
// metadata) has landed, [1][s][i] once combine row i of slot s (and its weights) has; the value is
// the call's epoch (epoch counters kSigDispatchDone / kSigCombineDone), so flags only grow and are
// never reset. Dispatch and combine share `data` and `weights`: every call starts with a barrier
// whose signal a rank sends only after its stream finished the previous call, so the uses never
// overlap.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moe_ep {
namespace intranode {

constexpr int kMaxPeers = 8;  // == comm.h kMaxRanks (checked in the .cu files)
constexpr int kMaxTopk = 16;
constexpr int kSignalWords = 16 * kMaxPeers;  // uint64 flags per rank: comm.h kNumSignalSlots * kMaxRanks
constexpr int kEpochCounters = 16;            // comm.h kNumEpochs

// The fixed dimensions of one Buffer.
struct Dims {
  int rank;
  int nranks;       // R
  int max_tokens;   // T
  int hidden;       // H
  int num_topk;     // K
  int num_experts;  // E (E_l = E / R per rank)
};

// Byte offsets of the regions inside one rank's workspace (see the top of this file).
struct WorkspaceLayout {
  uint64_t counts;
  uint64_t data;
  uint64_t topk;
  uint64_t weights;
  uint64_t src_index;
  uint64_t scales;
  uint64_t total;       // bytes of the whole workspace
  uint64_t slot_bytes;  // bytes of one source's slot in `data`: T * 2H
  int count_stride;     // int32 entries per counts row: 1 + E_l, rounded up to 4
};

inline WorkspaceLayout workspace_layout(const Dims& d) {
  const auto align = [](uint64_t bytes) { return (bytes + 255) / 256 * 256; };
  const uint64_t R = d.nranks, T = d.max_tokens, H = d.hidden, K = d.num_topk;
  WorkspaceLayout w{};
  w.count_stride = (1 + d.num_experts / d.nranks + 3) / 4 * 4;
  w.slot_bytes = T * 2 * H;
  uint64_t at = 0;
  const auto take = [&](uint64_t bytes) { const uint64_t start = at; at += align(bytes); return start; };
  w.counts = take(2 * R * w.count_stride * sizeof(int32_t));
  w.data = take(R * w.slot_bytes);
  w.topk = take(R * T * K * sizeof(int64_t));
  w.weights = take(R * T * K * sizeof(float));
  w.src_index = take(R * T * sizeof(int32_t));
  w.scales = take(R * T * (H / 128) * sizeof(float));
  w.total = at;
  return w;
}

// Run-time tuning of dispatch and combine: moe_ep.Config's knobs (moe_ep/config.py documents them),
// set per Buffer or per call through IntranodeContext::set_tuning. Results never depend on it: it
// only changes which warp moves which row when, and how many loads each keeps in flight.
struct Tuning {
  int send_warps;  // dispatch: warps per block that send first (1..kWarps); the others receive from the start
  int combine_send_warps;  // combine: warps per block that send first; the others reduce from the start
  int unroll;      // int4 loads in flight per lane in row copies: 4 or 6 (a template parameter)
  int flag_batch;  // row flags a sending warp raises per system fence (1..32)
  int recv_run;    // dispatch: consecutive positions per receive work item (1..32); combine: tokens
};

constexpr int kHostWarps = 32;  // == kWarps (warps per dispatch / combine block)

// Everything the kernels need that stays fixed for a Buffer: device addresses as seen from this GPU.
struct Context {
  Dims dims;
  WorkspaceLayout ws;
  unsigned long long timeout_ns;
  uintptr_t error;                   // ErrorState*, device address of host-mapped memory
  uintptr_t epochs;                  // unsigned long long[kNumEpochs], device (slots 0..4 are ours)
  uintptr_t signals[kMaxPeers];      // every rank's signal array
  uintptr_t workspace[kMaxPeers];    // every rank's workspace
  uintptr_t row_flags[kMaxPeers];    // every rank's row flags
  uintptr_t block_counters;          // int32[4], zero between kernels: blocks done ([0] dispatch,
                                     // [1] combine), next receive work item ([2] dispatch, [3] combine)
  uintptr_t layout_scratch;          // int32[R + E]: tokens per rank, then per expert (notify)
  Tuning tuning;
};

// get_dispatch_layout: one block over topk_idx [N, K] int64.
struct LayoutArgs {
  uintptr_t topk_idx;           // [N, K] int64
  int num_tokens;               // N
  uintptr_t tokens_per_rank;    // out [R] int32
  uintptr_t tokens_per_expert;  // out [E] int32 (a token naming an expert twice counts once)
  uintptr_t is_token_in_rank;   // out [N, R] bool
  uintptr_t pos;                // out [N, R] int32: rank of token n among those sent to r, else -1; or 0
};

// Layout plus count exchange (the start barrier of a dispatch). recv_info layout, int32:
//   [0, R) rows from each source; [R, 2R) first output row of each source's rows (worst case: s*T);
//   [2R, 2R + E_l) received rows per local expert (not aligned).
struct NotifyArgs {
  uintptr_t topk_idx;           // [N, K] int64
  int num_tokens;
  uintptr_t is_token_in_rank;   // out [N, R] bool
  uintptr_t pos;                // out [N, R] int32
  uintptr_t recv_info;          // out [2R + E_l] int32, device
  uintptr_t tokens_per_expert;  // out [E_l] int32, device: recv_info's counts aligned up
  uintptr_t host_info;          // out [R + E_l] int32 host-mapped (rows per source, raw per expert), or 0
  int expert_alignment;
  bool worst_case;
};

struct DispatchArgs {
  uintptr_t x;                  // [N, row_bytes]
  uintptr_t x_scales;           // [N, num_scales] float32, or 0
  uintptr_t topk_idx;           // [N, K] int64, 0 for a cached dispatch
  uintptr_t topk_weights;       // [N, K] float32, 0 for a cached dispatch
  uintptr_t pos;                // [N, R] int32 from notify
  uintptr_t recv_info;          // from notify
  int num_tokens;
  int row_bytes;                // 2H (bf16) or H (e4m3)
  int num_scales;               // H / 128 for FP8, else 0
  uintptr_t out_x;              // [M, row_bytes]
  uintptr_t out_scales;         // [M, num_scales] float32, or 0
  uintptr_t out_topk_idx;       // [M, K] int64, 0 for a cached dispatch
  uintptr_t out_topk_weights;   // [M, K] float32, 0 for a cached dispatch
  uintptr_t out_src_rank;       // [M] int32, 0 for a cached dispatch (the handle has it)
  uintptr_t out_src_index;      // [M] int32, 0 for a cached dispatch
  bool worst_case;              // M = R * T, source s at [s * T, s * T + count_s), the rest padding
  bool cached;                  // reuse pos / recv_info of an earlier dispatch; no topk in or out
  int num_blocks;
};

struct CombineArgs {
  uintptr_t x;                  // [M, H] bf16, the rows this rank received in the dispatch
  int num_rows;                 // M
  uintptr_t src_rank;           // [M] int32, -1 for padding
  uintptr_t src_index;          // [M] int32
  uintptr_t is_token_in_rank;   // [N, R] bool of this rank's tokens
  uintptr_t pos;                // [N, R] int32
  uintptr_t recv_info;          // the dispatch's
  int num_tokens;               // N
  uintptr_t out;                // [N, H] bf16
  bool with_weights;            // the call has weights: topk_weights travel with the rows, their sums
  uintptr_t topk_weights;       //   go to out_topk_weights (a pointer may be 0 when its tensor is empty)
  uintptr_t out_topk_weights;   // [M, K] and [N, K] float32
  int num_blocks;
};

void launch_layout(const Context& c, const LayoutArgs& a, uintptr_t stream);
void launch_notify(const Context& c, const NotifyArgs& a, uintptr_t stream);
void launch_dispatch(const Context& c, const DispatchArgs& a, uintptr_t stream);
void launch_combine(const Context& c, const CombineArgs& a, uintptr_t stream);

}  // namespace intranode
}  // namespace moe_ep

#if defined(__CUDACC__)
// Device-side pieces shared by the intranode .cu files.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "runtime/comm.h"
#include "runtime/error_check.h"

namespace moe_ep {
namespace intranode {

static_assert(kMaxPeers == kMaxRanks, "intranode.h kMaxPeers must equal comm.h kMaxRanks");
static_assert(kSignalWords == kNumSignalSlots * kMaxRanks, "intranode.h kSignalWords must match comm.h");
static_assert(kEpochCounters == kNumEpochs, "intranode.h kEpochCounters must equal comm.h kNumEpochs");

constexpr int kThreads = 1024;  // dispatch / combine block size: enough loads in flight per SM
constexpr int kWarps = kThreads / 32;
constexpr int kLayoutThreads = 1024;
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kWarps == kHostWarps, "intranode.h kHostWarps must equal kWarps");

enum RowFlagKind : int { kDispatchRows = 0, kCombineRows = 1 };

// What every intranode kernel receives (by value, as a __grid_constant__ parameter).
struct DeviceContext {
  Comm comm;
  Dims dims;
  WorkspaceLayout ws;
  Tuning tuning;
  char* workspace[kMaxRanks];
  uint64_t* row_flags[kMaxRanks];
  int* block_counters;
  int* layout_scratch;

  __device__ __forceinline__ char* region(int r, uint64_t offset) const { return workspace[r] + offset; }

  // The flag at rank `dst` that source `src` raises for row `row` of its slot.
  __device__ __forceinline__ uint64_t* row_flag(int dst, int kind, int src, int row) const {
    return row_flags[dst] + ((size_t)kind * comm.nranks + src) * dims.max_tokens + row;
  }
};

inline DeviceContext make_device_context(const Context& c) {
  DeviceContext d{};
  d.comm.rank = c.dims.rank;
  d.comm.nranks = c.dims.nranks;
  d.comm.timeout_ns = c.timeout_ns;
  d.comm.error = reinterpret_cast<ErrorState*>(c.error);
  d.comm.epochs = reinterpret_cast<unsigned long long*>(c.epochs);
  for (int r = 0; r < kMaxRanks; ++r) {
    d.comm.signals[r] = reinterpret_cast<uint64_t*>(c.signals[r]);
    d.workspace[r] = reinterpret_cast<char*>(c.workspace[r]);
    d.row_flags[r] = reinterpret_cast<uint64_t*>(c.row_flags[r]);
  }
  d.dims = c.dims;
  d.ws = c.ws;
  d.tuning = c.tuning;
  d.block_counters = reinterpret_cast<int*>(c.block_counters);
  d.layout_scratch = reinterpret_cast<int*>(c.layout_scratch);
  return d;
}

// Throws with the kernel's name when the launch failed.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// ---- Dispatch layout, computed by one block (the layout kernel and the notify kernel inline it) ----
// Both kernels are templates on kK, a compile-time bound on K (8 or 16), so per-token loops over the
// top-k entries are unrolled without issuing dead predicated iterations for K <= 8.
// Every thread of the block calls layout_counts, then (when pos is wanted) layout_positions; each
// ends with a barrier, after which its outputs are visible to the whole block. Notify exchanges the
// counts between the two, so the positions are computed while the peers' flags travel.
//  1. layout_counts: each thread first prefetches (into L2) the topk rows of all its tokens, so later
//     steps find them there. Then kExpertChunk experts at a time: the block zeroes a shared-memory
//     counter per expert of the chunk; thread t owns tokens t, t + kLayoutThreads, ...; it loads its
//     token's ids (16-byte loads when K is even), adds 1 (shared atomics) for each expert named for
//     the first time in the row (a token naming an expert twice counts once), and in the first chunk
//     also builds the token's rank bitmask (expert -> rank by comparisons, no division), writes
//     is_token_in_rank, and per rank a warp ballot whose popcount lane 0 adds to a shared counter.
//     One chunk covers E <= kExpertChunk; larger E repeats the pass per chunk.
//  2. layout_positions: kLayoutThreads tokens per step, thread t owning token step + t: each thread
//     rebuilds its token's rank bitmask from is_token_in_rank (written by this block in step 1, so
//     visible after its barrier; no topk reload); per rank, a warp ballot gives the token's offset
//     inside its warp and the warp's total; warp r then scans rank r's totals over the 32 warps
//     (adding the running total `carry[r]` of earlier steps), and every thread writes
//     pos = carry + warp offset + lane offset. Barriers separate the ballot, the scan and the reads
//     of its result, so each step's shared arrays are reused safely.
constexpr int kLayoutWarps = kLayoutThreads / 32;
constexpr int kExpertChunk = 8192;
static_assert(kLayoutWarps == 32, "the per-rank scan runs one lane per warp");

// Token n's expert ids in registers (entries k >= K are -1); K <= kK.
template <int kK>
struct TokenExperts {
  int id[kK];

  // Ids outside [0, E) become -1; one outside [-1, E) is recorded in `error` (checked_expert).
  __device__ __forceinline__ TokenExperts(const int64_t* topk_idx, int n, int num_topk, int num_experts,
                                          ErrorState* error) {
    const int64_t* row = topk_idx + (size_t)n * num_topk;
    if (num_topk % 2 == 0) {  // 16-byte aligned rows: two ids per load
#pragma unroll
      for (int q = 0; q < kK / 2; ++q) {
        longlong2 v = make_longlong2(-1, -1);
        if (2 * q < num_topk) v = __ldg(reinterpret_cast<const longlong2*>(row) + q);
        id[2 * q] = 2 * q < num_topk ? checked_expert(error, v.x, num_experts, n, 2 * q) : -1;
        id[2 * q + 1] = 2 * q < num_topk ? checked_expert(error, v.y, num_experts, n, 2 * q + 1) : -1;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kK; ++k)
        id[k] = k < num_topk ? checked_expert(error, __ldg(reinterpret_cast<const long long*>(row) + k), num_experts, n, k)
                             : -1;
    }
  }

  // Whether entry k is the first occurrence of its expert in the row.
  __device__ __forceinline__ bool first(int k) const {
    bool first = true;
#pragma unroll
    for (int j = 0; j < kK; ++j) first &= !(j < k && id[j] == id[k]);
    return first;
  }

  // Bit r set when an expert of the token lives on rank r (rank of e: how many q * E_l <= e).
  __device__ __forceinline__ unsigned ranks(int num_local, int nranks) const {
    unsigned mask = 0;
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      int r = 0;
#pragma unroll
      for (int q = 1; q < kMaxRanks; ++q) r += (q < nranks && id[k] >= q * num_local) ? 1 : 0;
      if (id[k] >= 0) mask |= 1u << r;
    }
    return mask;
  }
};

template <int kK>
__device__ __forceinline__ void layout_counts(const LayoutArgs& a, int num_topk, int num_experts, int nranks,
                                              ErrorState* error) {
  __shared__ int expert_count[kExpertChunk];
  __shared__ int rank_count[kMaxRanks];

  const int tid = threadIdx.x, lane = tid % 32;
  const int num_tokens = a.num_tokens, num_local = num_experts / nranks;
  const auto* topk_idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  auto* tokens_per_expert = reinterpret_cast<int*>(a.tokens_per_expert);
  auto* in_rank = reinterpret_cast<bool*>(a.is_token_in_rank);

  for (int n = tid; n < num_tokens; n += kLayoutThreads)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(topk_idx + (size_t)n * num_topk));
  if (tid < kMaxRanks) rank_count[tid] = 0;
  for (int e0 = 0; e0 < num_experts; e0 += kExpertChunk) {
    const int width = min(kExpertChunk, num_experts - e0);
    for (int i = tid; i < width; i += kLayoutThreads) expert_count[i] = 0;
    __syncthreads();
    for (int step = 0; step < num_tokens; step += kLayoutThreads) {
      const int n = step + tid;
      unsigned ranks = 0;
      if (n < num_tokens) {
        const TokenExperts<kK> t(topk_idx, n, num_topk, num_experts, error);
#pragma unroll
        for (int k = 0; k < kK; ++k) {
          const int e = t.id[k] - e0;  // -1 entries land below 0
          if (e >= 0 && e < width && t.first(k)) atomicAdd(&expert_count[e], 1);
        }
        if (e0 == 0) {
          ranks = t.ranks(num_local, nranks);
#pragma unroll
          for (int r = 0; r < kMaxRanks; ++r)
            if (r < nranks) in_rank[(size_t)n * nranks + r] = (ranks >> r) & 1u;
        }
      }
      if (e0 == 0) {
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) {
          if (r >= nranks) break;
          const unsigned votes = __ballot_sync(kFullMask, (ranks >> r) & 1u);
          if (lane == 0 && votes != 0) atomicAdd(&rank_count[r], __popc(votes));
        }
      }
    }
    __syncthreads();
    for (int i = tid; i < width; i += kLayoutThreads) tokens_per_expert[e0 + i] = expert_count[i];
    __syncthreads();
  }
  if (tid < nranks) reinterpret_cast<int*>(a.tokens_per_rank)[tid] = rank_count[tid];
  __syncthreads();
}

__device__ __forceinline__ void layout_positions(const LayoutArgs& a, int nranks) {
  __shared__ int warp_total[kLayoutWarps][kMaxRanks];
  __shared__ int warp_first[kLayoutWarps][kMaxRanks];
  __shared__ int carry[kMaxRanks];

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int num_tokens = a.num_tokens;
  const auto* in_rank = reinterpret_cast<const bool*>(a.is_token_in_rank);
  auto* pos = reinterpret_cast<int*>(a.pos);
  if (tid < nranks) carry[tid] = 0;
  for (int step = 0; step < num_tokens; step += kLayoutThreads) {
    const int n = step + tid;
    unsigned ranks = 0;
    if (n < num_tokens) {
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r)
        if (r < nranks && in_rank[(size_t)n * nranks + r]) ranks |= 1u << r;
    }
    int before[kMaxRanks];  // tokens of lower lanes of this warp that go to rank r
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      const unsigned votes = __ballot_sync(kFullMask, (ranks >> r) & 1u);
      before[r] = __popc(votes & ((1u << lane) - 1u));
      if (lane == 0 && r < nranks) warp_total[warp][r] = __popc(votes);
    }
    __syncthreads();
    if (warp < nranks) {  // warp r: exclusive scan of rank r's warp totals, plus the carry
      const int r = warp;
      const int mine = warp_total[lane][r];
      int inclusive = mine;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int up = __shfl_up_sync(kFullMask, inclusive, d);
        if (lane >= d) inclusive += up;
      }
      const int base = carry[r];
      warp_first[lane][r] = base + inclusive - mine;
      __syncwarp();
      if (lane == 31) carry[r] = base + inclusive;
    }
    __syncthreads();
    if (n < num_tokens) {
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) {
        if (r >= nranks) break;
        pos[(size_t)n * nranks + r] = (ranks >> r) & 1u ? warp_first[warp][r] + before[r] : -1;
      }
    }
  }
  __syncthreads();
}

// Threads r < R (r != rank) of the calling block store `epoch` into their flag at peer r.
__device__ __forceinline__ void signal_peers(const Comm& c, int slot, uint64_t epoch) {
  const int r = threadIdx.x;
  if (r < c.nranks && r != c.rank) st_release_sys(signal_at(c, r, slot, c.rank), epoch);
}

// Thread r of the block waits for peer r's flag >= epoch (acquire), then the whole block joins.
// Returns false in every thread when any wait gave up (timeout or an earlier error).
__device__ __forceinline__ bool wait_peers(const Comm& c, int slot, uint64_t epoch, int phase) {
  bool ok = true;
  const int r = threadIdx.x;
  if (r < c.nranks && r != c.rank) ok = wait_geq(c, signal_at(c, c.rank, slot, r), epoch, phase, r);
  return __syncthreads_and(ok) != 0;
}

// End of a kernel. Every thread fences, then thread 0 counts the block in; returns true (in thread 0
// of the last block to arrive only) once all gridDim.x blocks have arrived, i.e. once no thread of
// the grid will read the epochs or take work items again (fence / counter / fence). That thread
// resets the counter for the next kernel.
__device__ __forceinline__ bool arrive_last(int* counter) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x != 0) return false;
  if (atomicAdd(counter, 1) != static_cast<int>(gridDim.x) - 1) return false;
  __threadfence();
  *counter = 0;
  return true;
}

// This call's epoch for `slot`: epochs[slot] + 1. The counters change only in arrive_last's last
// block, after every thread of the grid is done with them, so any read during the kernel gives the
// same value; the volatile load lets kernels re-read it where needed instead of holding a register.
__device__ __forceinline__ uint64_t call_epoch(const Comm& c, int slot) {
  return *reinterpret_cast<volatile unsigned long long*>(c.epochs + slot) + 1;
}

// The next receive work item of the grid for the calling warp (lane 0 takes it, all lanes get it).
__device__ __forceinline__ int take_work_item(int* counter) {
  int item = 0;
  if (threadIdx.x % 32 == 0) item = atomicAdd(counter, 1);
  return __shfl_sync(kFullMask, item, 0);
}

// ---- Row flags ----
// Publishing: the writing warp makes its lanes' generic stores ordered (__syncwarp, so the fence
// below covers every lane), executes ONE fence.acq_rel.sys (one warp instruction) and then raises
// any number of flags with relaxed system-scope stores; each (fence, store) pair is a release
// pattern, so one fence serves a whole batch of rows (Tuning::flag_batch of them).
// Waiting: comm.h wait_geq polls with relaxed loads (no ordering cost per spin), then one acquire
// load of the flag, which pairs with the writer's release (the value only grows, so it still
// satisfies).

// Flags a sending warp has yet to raise (up to 32, kept in shared memory, `slots` being the warp's
// own 32 entries), and the system fence that publishes them all (see "Row flags" above). Every lane
// calls every method.
struct PendingFlags {
  uint64_t** slots;
  int count = 0;  // pending entries (the same in every lane)

  // Lane `from`'s flag `f` becomes pending entry `count`.
  __device__ __forceinline__ void add(uint64_t* f, int from, int lane) {
    if (lane == from) slots[count] = f;
    ++count;
  }
  __device__ __forceinline__ void publish(uint64_t epoch, int lane) {
    if (count == 0) return;
    __syncwarp();  // orders the lanes' data stores (and the slots) before the fence
    fence_acq_rel_sys();
    if (lane < count) st_relaxed_sys(slots[lane], epoch);
    __syncwarp();  // the slots are read before they are reused
    count = 0;
  }
};

// 16-byte load of data that stays constant during the kernel (kernel inputs): skips L1.
__device__ __forceinline__ int4 ld_nc_int4(const int4* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Lane k < K of a warp: token n's expert id k (checked_expert: -1, and recorded, when outside
// [-1, E)) and its router weight; other lanes get -1 and 0. Both normal-mode dispatch paths read
// their routing through it.
struct LaneRoute {
  int expert;
  float weight;
};

__device__ __forceinline__ LaneRoute lane_route(uintptr_t topk_idx, uintptr_t topk_weights, int n, int num_topk,
                                                int num_experts, ErrorState* error, int lane) {
  if (lane >= num_topk) return LaneRoute{-1, 0.f};
  const size_t at = (size_t)n * num_topk + lane;
  return LaneRoute{checked_expert(error, __ldg(reinterpret_cast<const long long*>(topk_idx) + at), num_experts, n, lane),
                   __ldg(reinterpret_cast<const float*>(topk_weights) + at)};
}

// The row copy of every normal-mode kernel: one warp copies src[0, count) to dst_of(d) for every bit
// d of `dests`. Per step each lane issues all its kU loads (`load`: LoadNc for kernel inputs, LoadCg
// for data another GPU or the NIC wrote) before any store, and each element is loaded once
// whatever the number of destinations. T: a 4-, 8- or 16-byte type; `dests` must be warp-uniform.
template <int kU, class T, class Load, class DstOf>
__device__ __forceinline__ void warp_copy(const T* src, int count, int lane, Load load, unsigned dests,
                                          DstOf dst_of) {
  for (int first = 0; first < count; first += 32 * kU) {
    T v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = first + u * 32 + lane;
      if (i < count) v[u] = load(src + i);
    }
    for (unsigned m = dests; m != 0; m &= m - 1) {
      T* dst = dst_of(__ffs(m) - 1);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = first + u * 32 + lane;
        if (i < count) dst[i] = v[u];
      }
    }
  }
}

struct LoadNc {
  __device__ __forceinline__ int4 operator()(const int4* p) const { return ld_nc_int4(p); }
};

struct LoadCg {  // through L2 (ld.cg): data another GPU wrote, already acquired
  template <class T>
  __device__ __forceinline__ T operator()(const T* p) const { return __ldcg(p); }
};

// dst[i] = src[i] for i < count, by one warp (warp_copy with one destination, src read by ld.cg).
template <int kU, class T>
__device__ __forceinline__ void warp_copy_cg(T* dst, const T* src, int count, int lane) {
  warp_copy<kU>(src, count, lane, LoadCg{}, 1u, [dst](int) { return dst; });
}

// Float32 accumulation of 8 bf16 values (one int4) with __fadd_rn (never contracted), and the one
// rounding back to bf16: the combine arithmetic of every normal-mode path.
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    acc[2 * q] = __fadd_rn(acc[2 * q], __uint_as_float(w[q] << 16));
    acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __uint_as_float(w[q] & 0xffff0000u));
  }
}

// Lane k < num_topk: dst[k] = the float32 sum from +0.0 (__fadd_rn), over i < count ascending, of
// src(i)[k] for the weight rows src(i) that are not null, read through L2 (another GPU or the NIC
// wrote them): the combined weights of every normal-mode path, never rounded. Every lane calls
// src(i) for every i (it may shuffle), so `count` must be warp-uniform.
template <class Src>
__device__ __forceinline__ void warp_sum_weights(float* dst, int count, Src src, int num_topk, int lane) {
  float acc = 0.f;
  for (int i = 0; i < count; ++i) {
    const float* w = src(i);
    if (w != nullptr && lane < num_topk) acc = __fadd_rn(acc, __ldcg(w + lane));
  }
  if (lane < num_topk) dst[lane] = acc;
}

__device__ __forceinline__ int4 round_bf16x8(const float (&acc)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * q]));
    const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * q + 1]));
    w[q] = lo | (hi << 16);
  }
  return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
}

}  // namespace intranode
}  // namespace moe_ep
#endif  // __CUDACC__
