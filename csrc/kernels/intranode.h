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
//                                      [T][H] that d returns to s, at s's original token index
//   topk      [R][T][K] int64          dispatch metadata, same positions as the rows: topk_idx as
//   weights   [R][T][K] float32        local expert ids of d (-1 elsewhere) and weights (0 there),
//   src_index [R][T] int32             the source token index,
//   scales    [R][T][H/128] float32    FP8 scales
// Row flags, uint64 [2][R][T]: [0][s][p] is raised by source s once dispatch row p of slot s (and its
// metadata) has landed, [1][s][i] once combine row i of slot s has; the value is the call's epoch
// (epoch counters kSigDispatchDone / kSigCombineDone), so flags only grow and are never reset.
// Dispatch rows and combine rows share `data`: every call starts with a barrier whose signal a rank
// sends only after its stream finished the previous call, so the two uses never overlap.
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

// Data-movement implementation of dispatch and combine (same protocol, same symmetric layout, so
// the two interoperate): kLsu copies rows with 16-byte loads/stores of 1024-thread blocks; kTma
// streams them through shared memory with bulk copies issued by one thread per pipeline.
enum class Impl : int { kLsu = 0, kTma = 1 };

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
  Impl impl;                         // which dispatch / combine kernels run
  int tma_send_rows;                 // TMA: rows per send wave (0: derived from shared memory)
  int tma_recv_rows;                 // TMA: rows per dispatch receive chunk (0: derived)
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
  int num_blocks;
};

// Rows per TMA wave (send) and chunk (dispatch receive), two groups of each in shared memory; zero
// send_rows when a row is too large to double-buffer (the launchers then run the LSU kernels).
struct TmaShape {
  int send_rows;
  int recv_rows;
  int smem_bytes;
};

constexpr int kTmaSmemBytes = 200 * 1024;  // dynamic shared memory a TMA block may use
constexpr int kTmaMaxRowsHost = 8;         // == tma::kMaxRows

inline TmaShape tma_shape(const Context& c, int row_bytes, bool receive) {
  const auto clamp = [](int v) { return v < 1 ? 1 : (v > kTmaMaxRowsHost ? kTmaMaxRowsHost : v); };
  const int fit = kTmaSmemBytes / row_bytes;  // rows that fit
  TmaShape t{};
  if (receive) {
    if (fit < 4) return t;
    t.send_rows = c.tma_send_rows > 0 ? clamp(c.tma_send_rows) : clamp(fit * 2 / 7);
    if (2 * t.send_rows > fit - 2) t.send_rows = (fit - 2) / 2;
    t.recv_rows = c.tma_recv_rows > 0 ? clamp(c.tma_recv_rows) : clamp((fit - 2 * t.send_rows) / 2);
    if (2 * (t.send_rows + t.recv_rows) > fit) t.recv_rows = fit / 2 - t.send_rows;
  } else {
    if (fit < 2) return t;
    t.send_rows = c.tma_send_rows > 0 ? clamp(c.tma_send_rows) : clamp(fit / 2);
    if (2 * t.send_rows > fit) t.send_rows = fit / 2;
  }
  t.smem_bytes = 2 * (t.send_rows + t.recv_rows) * row_bytes;
  return t;
}

void launch_layout(const Context& c, const LayoutArgs& a, uintptr_t stream);
void launch_notify(const Context& c, const NotifyArgs& a, uintptr_t stream);
void launch_dispatch(const Context& c, const DispatchArgs& a, uintptr_t stream);
void launch_combine(const Context& c, const CombineArgs& a, uintptr_t stream);

}  // namespace intranode
}  // namespace moe_ep

#if defined(__CUDACC__)
// Device-side pieces shared by the intranode .cu files.
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
constexpr int kSendWarps = 24;  // warps per block that send first; the others receive from the start
constexpr int kLayoutThreads = 1024;
constexpr unsigned kFullMask = 0xffffffffu;

enum RowFlagKind : int { kDispatchRows = 0, kCombineRows = 1 };

// What every intranode kernel receives (by value, as a __grid_constant__ parameter).
struct DeviceContext {
  Comm comm;
  Dims dims;
  WorkspaceLayout ws;
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
  d.block_counters = reinterpret_cast<int*>(c.block_counters);
  d.layout_scratch = reinterpret_cast<int*>(c.layout_scratch);
  return d;
}

// Throws with the kernel's name when the launch failed.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// Raises `kernel`'s dynamic shared-memory limit on the current device to `bytes` (callers pass the
// most they will ever use) once per device, so no later call, e.g. inside a CUDA graph capture,
// reconfigures it. Host code, one thread per
// process launches (the caller holds the GIL).
template <class Kernel>
void ensure_dynamic_smem(Kernel kernel, int bytes, const char* what) {
  constexpr int kMaxDevices = 64;
  static int granted[kMaxDevices] = {};
  int device = 0;
  check_cuda(cudaGetDevice(&device), what);
  if (device < kMaxDevices && granted[device] >= bytes) return;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what);
  if (device < kMaxDevices) granted[device] = bytes;
}

// ---- Dispatch layout, computed by one block (the layout kernel and the notify kernel inline it) ----
// Every thread of the block calls layout_counts, then layout_positions; each ends with a barrier,
// after which its outputs are visible to the whole block. Notify exchanges the counts between the
// two, so the positions are computed while the peers' flags travel.
//  1. layout_counts: tokens per expert and per rank, kExpertChunk experts at a time: the block zeroes
//     a shared-memory counter per expert of the chunk, every thread adds 1 (shared atomics) for each
//     expert its token names for the first time in its row (a token naming an expert twice counts
//     once), then the counters are written out. In the first chunk each warp also counts, per rank,
//     its tokens that go there (ballot; lane 0 adds the popcount to a shared counter). One chunk
//     covers E <= 8192; larger E repeats the pass per chunk.
//  2. layout_positions: kLayoutThreads tokens per step, thread t owning token step + t: each thread
//     builds its token's rank bitmask; per rank, a warp ballot gives the token's offset inside its
//     warp and the warp's total; warp r then scans rank r's totals over the 32 warps (adding the
//     running total `carry[r]` of earlier steps), and every thread writes is_token_in_rank and
//     pos = carry + warp offset + lane offset. Barriers separate the ballot, the scan and the reads
//     of its result, so each step's shared arrays are reused safely.
constexpr int kLayoutWarps = kLayoutThreads / 32;
constexpr int kExpertChunk = 8192;
static_assert(kLayoutWarps == 32, "the per-rank scan runs one lane per warp");

// The token's expert ids in registers (unused entries -1); K <= kMaxTopk.
struct TokenExperts {
  int id[kMaxTopk];

  __device__ __forceinline__ TokenExperts(const int64_t* topk_idx, int n, int num_topk) {
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) id[k] = k < num_topk ? static_cast<int>(topk_idx[(size_t)n * num_topk + k]) : -1;
  }

  // Whether entry k is the first occurrence of its expert in the row.
  __device__ __forceinline__ bool first(int k) const {
    bool first = true;
#pragma unroll
    for (int j = 0; j < kMaxTopk; ++j) first &= !(j < k && id[j] == id[k]);
    return first;
  }

  // Bit r set when an expert of the token lives on rank r.
  __device__ __forceinline__ unsigned ranks(int num_local) const {
    unsigned mask = 0;
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)
      if (id[k] >= 0) mask |= 1u << (id[k] / num_local);
    return mask;
  }
};

__device__ __forceinline__ void layout_counts(const LayoutArgs& a, int num_topk, int num_experts, int nranks) {
  __shared__ int expert_count[kExpertChunk];
  __shared__ int rank_count[kMaxRanks];

  const int tid = threadIdx.x, lane = tid % 32;
  const int num_tokens = a.num_tokens, num_local = num_experts / nranks;
  const auto* topk_idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  auto* tokens_per_expert = reinterpret_cast<int*>(a.tokens_per_expert);

  if (tid < kMaxRanks) rank_count[tid] = 0;
  for (int e0 = 0; e0 < num_experts; e0 += kExpertChunk) {
    const int width = min(kExpertChunk, num_experts - e0);
    for (int i = tid; i < width; i += kLayoutThreads) expert_count[i] = 0;
    __syncthreads();
    for (int step = 0; step < num_tokens; step += kLayoutThreads) {
      const int n = step + tid;
      unsigned ranks = 0;
      if (n < num_tokens) {
        const TokenExperts t(topk_idx, n, num_topk);
#pragma unroll
        for (int k = 0; k < kMaxTopk; ++k) {
          const int e = t.id[k] - e0;  // -1 entries land below 0
          if (e >= 0 && e < width && t.first(k)) atomicAdd(&expert_count[e], 1);
        }
        ranks = t.ranks(num_local);
      }
      if (e0 == 0) {
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) {
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

__device__ __forceinline__ void layout_positions(const LayoutArgs& a, int num_topk, int num_experts, int nranks) {
  __shared__ int warp_total[kLayoutWarps][kMaxRanks];
  __shared__ int warp_first[kLayoutWarps][kMaxRanks];
  __shared__ int carry[kMaxRanks];

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int num_tokens = a.num_tokens, num_local = num_experts / nranks;
  const auto* topk_idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  auto* in_rank = reinterpret_cast<bool*>(a.is_token_in_rank);
  auto* pos = reinterpret_cast<int*>(a.pos);
  if (tid < nranks) carry[tid] = 0;
  for (int step = 0; step < num_tokens; step += kLayoutThreads) {
    const int n = step + tid;
    const unsigned ranks = n < num_tokens ? TokenExperts(topk_idx, n, num_topk).ranks(num_local) : 0u;
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
        const bool sent = (ranks >> r) & 1u;
        in_rank[(size_t)n * nranks + r] = sent;
        if (pos != nullptr) pos[(size_t)n * nranks + r] = sent ? warp_first[warp][r] + before[r] : -1;
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

// One thread stores `epoch` into its flag at every peer.
__device__ __forceinline__ void signal_peers_from_one_thread(const Comm& c, int slot, uint64_t epoch) {
  for (int r = 0; r < c.nranks; ++r)
    if (r != c.rank) st_release_sys(signal_at(c, r, slot, c.rank), epoch);
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

// The next receive work item of the grid for the calling warp (lane 0 takes it, all lanes get it).
__device__ __forceinline__ int take_work_item(int* counter) {
  int item = 0;
  if (threadIdx.x % 32 == 0) item = atomicAdd(counter, 1);
  return __shfl_sync(kFullMask, item, 0);
}

// ---- Row flags ----
// Publishing: the writer makes its data visible (generic stores: a __syncwarp so the fence below
// covers every lane; bulk stores: cp.async.bulk.wait_group then fence.proxy.async), executes ONE
// fence.acq_rel.sys and then raises any number of flags with relaxed system-scope stores; each
// (fence, store) pair is a release pattern, so one fence serves a whole batch of rows.
// Waiting: poll with relaxed loads (no ordering cost per spin), then one acquire load of the
// flag, which pairs with the writer's release (the value only grows, so it still satisfies).
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Spin until *flag >= target, then acquire. Timeouts and aborts as comm.h wait_geq.
__device__ __forceinline__ bool wait_flag(const Comm& c, const uint64_t* flag, uint64_t target, int phase, int peer) {
  if (ld_relaxed_sys(flag) < target) {
    const uint64_t start = global_timer_ns();
    for (uint32_t spin = 1; ld_relaxed_sys(flag) < target; ++spin) {
      if ((spin & 1023u) == 0) {
        if (comm_aborted(c)) return false;
        if (global_timer_ns() - start > c.timeout_ns) {
          report_timeout(c, phase, peer);
          return false;
        }
      }
    }
  }
  return ld_acquire_sys(flag) >= target;
}

// ---- Bulk copies (TMA, sm_90) ----
// Loads global -> shared complete on an mbarrier (one arrival: the issuing thread's expect(), plus
// the bytes); stores shared -> global are tracked per thread in bulk groups (one commit per batch):
// wait_read<N> frees the shared memory of all but the newest N groups, wait_done<N> waits until
// their writes are performed (for a peer address: landed at the peer).
namespace tma {

constexpr int kMaxRows = 8;  // rows per wave / chunk (two groups of them per pipeline)

__device__ __forceinline__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void init_barrier(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(bar)) : "memory");
}

// Makes initialised barriers visible to the async proxy (before the block-wide barrier that follows).
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// The issuing thread's arrival, announcing `bytes` of loads (0: the phase completes at once).
__device__ __forceinline__ void expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void load(void* dst_smem, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem(dst_smem)), "l"(src), "r"(bytes), "r"(smem(bar)) : "memory");
}

// Waits for the phase with the given parity of `bar`; the loaded bytes are then visible to the caller.
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  asm volatile("{\n .reg .pred done;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               " @!done bra WAIT_%=;\n}" ::"r"(smem(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void store(void* dst, const void* src_smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem(src_smem)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }

template <int N>
__device__ __forceinline__ void wait_done() { asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory"); }

// Orders this thread's generic-proxy view of global memory with its bulk copies (both directions).
__device__ __forceinline__ void fence_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

}  // namespace tma

static_assert(tma::kMaxRows == kTmaMaxRowsHost, "tma::kMaxRows must equal kTmaMaxRowsHost");

// ---- TMA send pipeline of dispatch and combine: one warp, lane 0 issues every bulk copy ----
// Items (tokens or received rows) are cut into waves of B consecutive items; wave k belongs to block
// k % gridDim.x, so rows reach every destination roughly in position order. Wave w of this block
// uses shared-memory group w % 2 (B row stages, mbarrier w % 2) and routing table w % 4 (Plan::width
// ints per item, read by the lanes two waves ahead). Iteration w:
//   1. lane 0 waits for wave w's loads, bulk-stores each row to all its destinations, commits one
//      bulk group (an empty one when the wave sends nothing: one group per wave);
//   2. lane 0 loads wave w+1 into the other group once wave w-1's stores have read it (wait_read<1>);
//   3. lane 0 publishes wave w-1: wait_done<1> (its stores have landed), proxy fence (bulk writes ->
//      generic view), fence.acq_rel.sys, then one relaxed flag store per remote row; the lanes stored
//      that wave's metadata in iteration w-1, before the __syncwarp that precedes this;
//   4. the lanes store wave w's metadata (Plan::metadata, generic stores) and the table of wave w+2.
// Flags thus trail their rows by one wave and cost one system fence per wave, while two waves of
// rows stay in flight. Nothing here waits for a peer, so sending always finishes.
template <class Plan>
__device__ __forceinline__ void tma_send(const Plan& plan, char* stages, uint64_t* bars,
                                         int (*table)[tma::kMaxRows][kMaxRanks], int B, uint64_t epoch) {
  constexpr int kPerLane = tma::kMaxRows * kMaxRanks / 32;
  const int lane = threadIdx.x % 32, W = plan.width, row = plan.row_bytes;
  const int waves = (plan.items + B - 1) / B;
  const int mine = static_cast<int>(blockIdx.x) < waves ? (waves - 1 - static_cast<int>(blockIdx.x)) / gridDim.x + 1 : 0;
  if (mine == 0) return;
  const auto first = [&](int w) { return (static_cast<int>(blockIdx.x) + w * static_cast<int>(gridDim.x)) * B; };
  const auto count = [&](int w) { return min(B, plan.items - first(w)); };
  const auto fetch = [&](int w, int(&v)[kPerLane]) {
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      const int e = lane + 32 * u;
      v[u] = -1;
      if (w < mine && e < B * W && e / W < count(w)) v[u] = plan.entry(first(w) + e / W, e % W);
    }
  };
  const auto put = [&](int w, const int(&v)[kPerLane]) {
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      const int e = lane + 32 * u;
      if (e < B * W) table[w % 4][e / W][e % W] = v[u];
    }
  };
  const auto stage = [&](int w, int t) { return stages + (size_t)((w & 1) * B + t) * row; };
  const auto issue_loads = [&](int w) {
    uint32_t bytes = 0;
    for (int t = 0; t < count(w); ++t)
      if (plan.wanted(table[w % 4][t])) bytes += row;
    tma::expect(&bars[w & 1], bytes);
    for (int t = 0; t < count(w); ++t)
      if (plan.wanted(table[w % 4][t])) tma::load(stage(w, t), plan.source(first(w) + t), row, &bars[w & 1]);
  };
  const auto issue_stores = [&](int w) {
    tma::wait(&bars[w & 1], (w >> 1) & 1);
    for (int t = 0; t < count(w); ++t)
      plan.for_each_dest(table[w % 4][t], [&](char* dst, uint64_t*) { tma::store(dst, stage(w, t), row); });
    tma::commit();
  };
  const auto publish = [&](int w) {
    tma::fence_global();
    fence_acq_rel_sys();
    for (int t = 0; t < count(w); ++t)
      plan.for_each_dest(table[w % 4][t], [&](char*, uint64_t* flag) {
        if (flag != nullptr) st_relaxed_sys(flag, epoch);
      });
  };

  int v[kPerLane];
  fetch(0, v);
  put(0, v);
  fetch(1, v);
  put(1, v);
  __syncwarp();
  if (lane == 0) {
    tma::fence_global();  // the start barrier's acquire (generic) before this thread's bulk writes
    issue_loads(0);
  }
  for (int w = 0; w < mine; ++w) {
    fetch(w + 2, v);
    if (lane == 0) {
      issue_stores(w);
      if (w + 1 < mine) {
        tma::wait_read<1>();
        issue_loads(w + 1);
      }
      if (w >= 1) {
        tma::wait_done<1>();
        publish(w - 1);
      }
    }
    __syncwarp();
    plan.metadata(first(w), count(w), table[w % 4], lane);
    put(w + 2, v);
    __syncwarp();
  }
  if (lane == 0) {
    tma::wait_done<0>();
    publish(mine - 1);
  }
  __syncwarp();
}

// 16-byte load of data that stays constant during the kernel (kernel inputs): skips L1.
__device__ __forceinline__ int4 ld_nc_int4(const int4* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

}  // namespace intranode
}  // namespace moe_ep
#endif  // __CUDACC__
