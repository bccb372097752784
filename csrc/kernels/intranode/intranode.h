// Normal-mode (training / prefill) dispatch and combine over NVLink: host-side parameters, the
// symmetric workspace layout and the kernel launchers.
//
// The first part is plain C++ (no device code, no comm.h) so that bindings.cpp in this folder
// compiles with the host compiler; the part under __CUDACC__ holds the device code shared by
// layout.cu, notify.cu, dispatch.cu and combine.cu in this folder (the dispatch layout itself is in
// dispatch_layout.cuh; the toolkit the cross-node kernels share with them is in kernels/common/).
//
// Symmetric memory of a Buffer besides its comm.h signal array: two allocations with the same layout
// on every rank. "Slot s" of a region on rank d holds what rank s wrote there; only rank s writes it.
// Workspace (WorkspaceLayout):
//   counts    [2][R][count_stride]     int32; set [notify epoch % 2], row s: tokens s sends to d, then
//                                      d's E_l local experts' token counts among them, then s's call
//                                      stamp (kStampWords, runtime/call_stamp.h) (notify.cu)
//   data      [R][T][2H bytes]         dispatch: the rows s sends to d, at the position of each token
//                                      among s's tokens for d (so slot s is already in final order),
//                                      packed at the row size (2H bf16, H e4m3); combine: bf16 rows
//                                      [T][H] that s returns to d, at d's original token index.
//                                      A dispatch with expert_major leaves its rows here (d's own
//                                      rows too, in slot d) for expand.cu to copy out as pairs
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
// overlap. A call streamed in rounds of at most T tokens (moe_ep/comm/backends/engine.py) is, to
// these kernels, a sequence of such calls: every round's dispatch follows a notify (its barrier),
// and recv_info's first row per source places the round's rows inside the whole output.
#pragma once
#include <cstddef>
#include <cstdint>

#include "runtime/call_stamp.h"
#include "runtime/limits.h"

namespace moe_ep {
namespace intranode {

constexpr int kSignalWords = 16 * kMaxNodeRanks;  // uint64 flags per rank: comm.h kNumSignalSlots * kMaxNodeRanks
constexpr int kHostNumEpochs = 16;           // comm.h kNumEpochs

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
  int count_stride;     // int32 entries per counts row: 1 + E_l + kStampWords, rounded up to 4
};

inline WorkspaceLayout workspace_layout(const Dims& d) {
  const auto align = [](uint64_t bytes) { return (bytes + 255) / 256 * 256; };
  const uint64_t R = d.nranks, T = d.max_tokens, H = d.hidden, K = d.num_topk;
  WorkspaceLayout w{};
  w.count_stride = (1 + d.num_experts / d.nranks + kStampWords + 3) / 4 * 4;
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

// Run-time tuning of dispatch and combine: moe_ep.Config's knobs (moe_ep/comm/config.py documents them),
// set per Buffer or per call through IntranodeContext::set_tuning. Results never depend on it: it
// only changes which warp moves which row when, and how many loads each keeps in flight.
struct Tuning {
  int send_warps;  // dispatch: warps per block that send first (1..kWarps); the others receive from the start
  int combine_send_warps;  // combine: warps per block that send first; the others reduce from the start
  int unroll;      // int4 loads in flight per lane in row copies: a bit of kUnrollValues (a template parameter)
  int flag_batch;  // row flags a sending warp raises per system fence (1..32)
  int recv_run;    // dispatch: consecutive positions per receive work item (1..32); combine: tokens
};

constexpr int kHostWarps = 32;  // == kWarps (warps per dispatch / combine block)
// Tuning::unroll values the launchers instantiate, bit u for u: 4 and 6 (7, whole steps over a 7168-wide
// row, measured no faster than 6 on one H100 and was dropped). moe_ep.Config reads it as TUNING_UNROLL_MASK.
constexpr int kUnrollValues = (1 << 4) | (1 << 6);

// Context::block_counters: grid-wide counters, each back at zero when its kernel ends (the last block
// to arrive resets it): blocks done, next receive work item, notify's next slice and blocks done.
enum BlockCounter : int {
  kDispatchDone = 0, kCombineDone = 1, kDispatchWork = 2, kCombineWork = 3, kNotifySlice = 4, kNotifyDone = 5,
  kBlockCounters = 6
};

// Notify's grid: one block per kNotifySliceTokens tokens (at least 1, at most kMaxNotifyBlocks), each
// block the layout of one slice of the tokens (notify.cu).
constexpr int kNotifySliceTokens = 512;
constexpr int kMaxNotifyBlocks = 32;

// Context::layout_scratch, in int32 words: the slices' flags ([kMaxNotifyBlocks] uint64: the notify
// epoch once slice s's counts are in), the slices' tokens per rank ([kMaxNotifyBlocks][kMaxNodeRanks]),
// then this call's tokens per rank [R] and per expert [E] (the latter summed by atomics over the
// slices: zero between notifies, so the buffer starts zeroed and the last block re-zeroes it).
constexpr int kScratchSliceFlags = 0;
constexpr int kScratchSliceCounts = 2 * kMaxNotifyBlocks;
constexpr int kScratchTokensPerRank = kScratchSliceCounts + kMaxNotifyBlocks * kMaxNodeRanks;
inline size_t layout_scratch_words(int nranks, int num_experts) {
  return (size_t)kScratchTokensPerRank + nranks + num_experts;
}

// Everything the kernels need that stays fixed for a Buffer: device addresses as seen from this GPU.
struct Context {
  Dims dims;
  WorkspaceLayout ws;
  unsigned long long timeout_ns;
  uintptr_t error;                   // ErrorState*, device address of host-mapped memory
  uintptr_t verdict;                 // int32, device: the stamp verdict (comm.h)
  uintptr_t epochs;                  // unsigned long long[kNumEpochs], device (slots 0..4 are ours)
  uintptr_t signals[kMaxNodeRanks];      // every rank's signal array
  uintptr_t workspace[kMaxNodeRanks];    // every rank's workspace
  uintptr_t row_flags[kMaxNodeRanks];    // every rank's row flags
  uintptr_t block_counters;          // int32[kBlockCounters], zero between kernels (BlockCounter)
  uintptr_t layout_scratch;          // int32[layout_scratch_words(R, E)], zero at first (notify's layout)
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
  uintptr_t host_info;          // out [R + E_l + R * kStampWords] int32 host-mapped (rows per source, raw per
                                //   expert, every rank's stamp), or 0: the context's mailbox, set by
                                //   IntranodeContext.notify (not a Python field)
  int expert_alignment;
  bool worst_case;
  int stamp[kStampWords];       // this rank's call stamp (set by IntranodeContext.notify, not a Python field)
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
  int num_rows;                 // M, rows of the out_ tensors (R * T in worst-case mode); only the host check reads it
  uintptr_t out_x;              // [M, row_bytes]
  uintptr_t out_scales;         // [M, num_scales] float32, or 0
  uintptr_t out_topk_idx;       // [M, K] int64, 0 for a cached dispatch
  uintptr_t out_topk_weights;   // [M, K] float32, 0 for a cached dispatch
  uintptr_t out_src_rank;       // [M] int32, 0 for a cached dispatch (the handle has it)
  uintptr_t out_src_index;      // [M] int32, 0 for a cached dispatch
  bool worst_case;              // M = R * T, source s at [s * T, s * T + count_s), the rest padding
  bool cached;                  // reuse pos / recv_info of an earlier dispatch; no topk in or out
  bool expert_major;            // x rows stay in the workspace's data slots (own rows in slot `rank`) and
                                //   out_x is 0: the next launch on the stream must be expand, before any
                                //   later call lets peers write the workspace again
  int num_blocks;
};

// Expand (expand.cu): the rows an expert_major dispatch left in the workspace, copied out as
// (row, local expert) pairs: pair q gets received row rows[q] (output order of the dispatch: source
// src_rank[row], position row - first row of that source, i.e. recv_info[R + s]); rows[q] = -1 is
// alignment padding and gets zeros. Scales, for FP8 rows, come from the dispatch's out_scales.
struct ExpandArgs {
  uintptr_t rows;               // [P] int64, received row of each pair or -1
  int num_pairs;                // P, at most M_max * min(K, E_l) + (expert_alignment - 1) * E_l (M_max = R * T)
  int num_rows;                 // M, rows the dispatch received
  int expert_alignment;         // the layout's: each local expert's block of pairs a multiple of it
  uintptr_t src_rank;           // [M] int32, the dispatch's
  uintptr_t recv_info;          // the dispatch's
  int row_bytes;                // 2H (bf16) or H (e4m3)
  int num_scales;               // H / 128 for FP8, else 0
  uintptr_t scales;             // [M, num_scales] float32 (the dispatch's out_scales), or 0
  uintptr_t out_x;              // [P, row_bytes]
  uintptr_t out_scales;         // [P, num_scales] float32, or 0
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

// The launchers. IntranodeContext (bindings.cpp in this folder) checks every argument struct first
// (check(dims, args): a pointer the call's sizes say it uses must not be 0, a size must fit the Dims).
void launch_layout(const Context& c, const LayoutArgs& a, uintptr_t stream);
void launch_notify(const Context& c, const NotifyArgs& a, uintptr_t stream);
void launch_dispatch(const Context& c, const DispatchArgs& a, uintptr_t stream);
void launch_combine(const Context& c, const CombineArgs& a, uintptr_t stream);
void launch_expand(const Context& c, const ExpandArgs& a, uintptr_t stream);

}  // namespace intranode
}  // namespace moe_ep

#if defined(__CUDACC__)
// Device-side pieces shared by the .cu files of this folder.
#include <cuda_runtime.h>

#include "kernels/common/warp.cuh"
#include "runtime/comm.h"

namespace moe_ep {
namespace intranode {

static_assert(kSignalWords == kNumSignalSlots * kMaxNodeRanks, "intranode.h kSignalWords must match comm.h");
static_assert(kHostNumEpochs == kNumEpochs, "intranode.h kHostNumEpochs must equal comm.h kNumEpochs");

constexpr int kThreads = 1024;  // dispatch / combine block size: enough loads in flight per SM
constexpr int kWarps = kThreads / 32;
static_assert(kWarps == kHostWarps, "intranode.h kHostWarps must equal kWarps");

enum RowFlagKind : int { kDispatchRows = 0, kCombineRows = 1 };

// What every intranode kernel receives (by value, as a __grid_constant__ parameter).
struct DeviceContext {
  Comm comm;
  Dims dims;
  WorkspaceLayout ws;
  Tuning tuning;
  char* workspace[kMaxNodeRanks];
  uint64_t* row_flags[kMaxNodeRanks];
  int* block_counters;
  int* layout_scratch;

  __device__ __forceinline__ char* region(int r, uint64_t offset) const { return workspace[r] + offset; }

  // layout_scratch's parts (Context::layout_scratch)
  __device__ __forceinline__ uint64_t* slice_flag(int s) const {
    return reinterpret_cast<uint64_t*>(layout_scratch + kScratchSliceFlags) + s;
  }
  __device__ __forceinline__ int* slice_counts(int s) const {
    return layout_scratch + kScratchSliceCounts + s * kMaxNodeRanks;
  }
  __device__ __forceinline__ int* tokens_per_rank() const { return layout_scratch + kScratchTokensPerRank; }
  __device__ __forceinline__ int* tokens_per_expert() const {
    return layout_scratch + kScratchTokensPerRank + comm.nranks;
  }

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
  d.comm.verdict = reinterpret_cast<const int*>(c.verdict);
  d.comm.epochs = reinterpret_cast<unsigned long long*>(c.epochs);
  for (int r = 0; r < kMaxNodeRanks; ++r) {
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

// This call's epoch for `slot`: epochs[slot] + 1. The counters change only in arrive_last's last
// block, after every thread of the grid is done with them, so any read during the kernel gives the
// same value; the volatile load lets kernels re-read it where needed instead of holding a register.
__device__ __forceinline__ uint64_t call_epoch(const Comm& c, int slot) {
  return *reinterpret_cast<volatile unsigned long long*>(c.epochs + slot) + 1;
}

// The grid's receive work items as one warp takes them (grid-wide counter, lane 0's atomicAdd), one
// ahead: the item after the current one is taken when the current one is handed out, so the atomic's
// round trip overlaps the current item's work instead of preceding the next. A warp's items increase,
// so once one is past the end every later one is too: no item it took is left undone.
struct WorkItems {
  int* counter;
  int ahead;  // lane 0: the warp's next item

  __device__ __forceinline__ explicit WorkItems(int* c) : counter(c), ahead(0) {
    if (threadIdx.x % 32 == 0) ahead = atomicAdd(counter, 1);
  }

  // The warp's next item (every lane gets it); lane 0 then takes the one after, while below `end`.
  __device__ __forceinline__ int next(int end) {
    const int item = __shfl_sync(kFullMask, ahead, 0);
    if (threadIdx.x % 32 == 0 && item < end) ahead = atomicAdd(counter, 1);
    return item;
  }
};

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

}  // namespace intranode
}  // namespace moe_ep
#endif  // __CUDACC__
