// Low-latency (decode) dispatch/combine: host-side parameters and kernel launchers.
//
// This header is plain C++ (no device code, no comm.h) so that the pybind11 bindings compile with
// any host compiler; the .cu files turn LowLatencyParams into a comm.h Comm.
//
// Symmetric region (one allocation, same layout on every rank; byte offsets chosen by
// moe_ep/backends/low_latency.py and passed in LowLatencyParams). Each area has two sets, picked by
// the parity of the call's device-side epoch:
//   dispatch payload [2][R src][T][2H bytes]  bf16 row, or e4m3 row (H bytes) then H/128 float scales
//   dispatch meta    [2][R src][T][16] int16  the token's local expert id at this rank per k, else -1
//   combine payload  [2][T][K][H] bf16        expert output for (token, first k naming that expert)
#pragma once
#include <cstdint>

namespace moe_ep {
namespace ll {

constexpr int kMaxPeers = 8;      // == comm.h kMaxRanks (checked in the .cu files)
constexpr int kMetaEntries = 16;  // int16 expert ids per staged token (num_topk <= 16), padded with -1

struct LowLatencyParams {
  // Comm (see csrc/runtime/comm.h)
  int rank;
  int nranks;
  unsigned long long timeout_ns;
  uintptr_t error;                  // ErrorState*, device address of host-mapped memory
  uintptr_t epochs;                 // unsigned long long[kNumEpochs], device
  uintptr_t signals[kMaxPeers];     // every rank's signal array, as addressed from this GPU
  // dimensions
  int num_local_experts;
  int num_topk;
  int hidden;
  int max_tokens;                   // T
  // symmetric region: every rank's base address as addressed from this GPU, and area offsets
  uintptr_t sym[kMaxPeers];
  uint64_t dispatch_payload_offset;
  uint64_t dispatch_meta_offset;
  uint64_t combine_payload_offset;
  // private device state
  uintptr_t done_counters;          // int32[2]: blocks finished in the current send kernel
                                    // ([0] dispatch, [1] combine); the last block resets it to 0
  uintptr_t combine_stash;          // int64[T*K] topk ids then float32[T*K] weights, copied at send
  int blocks_per_expert;            // P: blocks sharing one local expert in the per-expert kernels;
                                    // the same on every rank (peers count the combine send's blocks)
};

constexpr int kMaxDispatchSendBlocks = 1024;

// Grid of the dispatch send kernel: one block per token slot up to kMaxDispatchSendBlocks (then
// blocks take several tokens). Fixed per Buffer and equal on every rank, whatever N is: receivers
// count these blocks' arrivals.
inline int dispatch_send_blocks(const LowLatencyParams& p) {
  return p.max_tokens < kMaxDispatchSendBlocks ? p.max_tokens : kMaxDispatchSendBlocks;
}

// Dispatch send half: quantise (optionally) and push every token to each rank holding one of its
// experts; every block then releases its arrival at every rank. x [N, H] bf16, topk_idx [N, K] int64.
void dispatch_send(const LowLatencyParams& p, uintptr_t x, uintptr_t topk_idx, int num_tokens, bool use_fp8,
                   bool round_scale, uintptr_t stream);

// Dispatch receive half: wait for every source, expand staged tokens into the expert-major rows.
// recv_x [E_l, R*T, H] (bf16, or e4m3 when use_fp8), recv_scales [E_l, R*T, H/128] float32 (fp8),
// src_rank / src_index / src_k [E_l, R*T] int32, count [E_l] int32.
void dispatch_recv(const LowLatencyParams& p, uintptr_t recv_x, uintptr_t recv_scales, uintptr_t src_rank,
                   uintptr_t src_index, uintptr_t src_k, uintptr_t count, bool use_fp8, uintptr_t stream);

// Combine send half: push every received row's expert output back to its token's rank.
// y [E_l, R*T, H] bf16; src_* and count from the dispatch; topk_idx [N, K] int64 and topk_weights
// [N, K] float32 of this rank's own tokens are stashed for the receive half.
void combine_send(const LowLatencyParams& p, uintptr_t y, uintptr_t src_rank, uintptr_t src_index, uintptr_t src_k,
                  uintptr_t count, uintptr_t topk_idx, uintptr_t topk_weights, int num_tokens, uintptr_t stream);

// Combine receive half: wait for every rank, then out[n] = bf16(sum_k w[n,k] * row) in ascending k.
void combine_recv(const LowLatencyParams& p, uintptr_t out, int num_tokens, uintptr_t stream);

}  // namespace ll
}  // namespace moe_ep

#if defined(__CUDACC__)
// Device-side pieces shared by low_latency_dispatch.cu and low_latency_combine.cu.
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

#include "runtime/comm.h"

namespace moe_ep {
namespace ll {

static_assert(kMaxPeers == kMaxRanks, "low_latency.h kMaxPeers must equal comm.h kMaxRanks");

// Signal slots of comm.h's low-latency range. A call with epoch e uses buffer set e & 1 and the slots
// of that parity. Entry [slot][src] at rank dst is written only by rank src.
//   8, 9   dispatch: blocks of src's send kernel that finished storing into dst (fence, relaxed add)
//   10, 11 combine:  the same for the combine send kernel
//   12, 13 dispatch: (e << 32) | N_src, stored by src's block 0 before its own add to slot 8 / 9
// The block counters only grow: after epoch e, slot (e & 1) holds G * ((e + 1) / 2), G being the
// fixed grid size of the send kernel (same on every rank: derived from the Buffer's dimensions).
constexpr int kSigDispatch = kSigLowLatencyFirst;       // 8, 9
constexpr int kSigCombine = kSigLowLatencyFirst + 2;    // 10, 11
constexpr int kSigDispatchCount = kSigLowLatencyFirst + 4;  // 12, 13
constexpr int kEpochDispatch = kSigLowLatencyFirst;     // epochs[8]: last dispatch epoch sent
constexpr int kEpochCombine = kSigLowLatencyFirst + 2;  // epochs[10]: last combine epoch sent
static_assert(kSigDispatchCount + 1 < kNumSignalSlots, "low-latency signal slots exceed comm.h's range");

inline Comm make_comm(const LowLatencyParams& p) {
  Comm c{};
  c.rank = p.rank;
  c.nranks = p.nranks;
  c.timeout_ns = p.timeout_ns;
  c.error = reinterpret_cast<ErrorState*>(p.error);
  c.epochs = reinterpret_cast<unsigned long long*>(p.epochs);
  for (int r = 0; r < kMaxRanks; ++r) c.signals[r] = reinterpret_cast<uint64_t*>(p.signals[r]);
  return c;
}

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("moe_ep low-latency ") + what + ": " + cudaGetErrorString(err));
}

// Value of a send kernel's block counter (slot of e's parity) once all `blocks` blocks of every
// epoch <= e with that parity have arrived.
__device__ __forceinline__ uint64_t arrivals_after(unsigned long long epoch, int blocks) {
  return static_cast<uint64_t>(blocks) * ((epoch + 1) >> 1);
}

// Flag primitives (comm.h): waiters poll with wait_relaxed_geq and issue one fence.acq_rel.sys once
// the value is seen (an acquire pattern); senders issue one fence.acq_rel.sys per block, then
// relaxed adds (a release pattern).

// A copy unit: one warp moves up to kChunkInt4 int4 with every load in flight before any store
// (one memory round trip per chunk). Rows are cut into chunks so that all warps of a block share
// the rows instead of one warp walking a whole row through several dependent round trips.
constexpr int kCopyUnroll = 8;
constexpr int kChunkInt4 = 32 * kCopyUnroll;  // 4 KB

__device__ __forceinline__ int chunks_of(int n_int4) { return (n_int4 + kChunkInt4 - 1) / kChunkInt4; }

// Loads int4 [chunk * kChunkInt4, min(n, (chunk + 1) * kChunkInt4)) of src into v (lane's share).
__device__ __forceinline__ void warp_load_chunk(int4 (&v)[kCopyUnroll], const int4* src, int n, int chunk, int lane) {
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int i = chunk * kChunkInt4 + u * 32 + lane;
    if (i < n) v[u] = src[i];
  }
}

// Stores what warp_load_chunk loaded for the same (n, chunk, lane).
__device__ __forceinline__ void warp_store_chunk(int4* dst, const int4 (&v)[kCopyUnroll], int n, int chunk, int lane) {
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int i = chunk * kChunkInt4 + u * 32 + lane;
    if (i < n) dst[i] = v[u];
  }
}

// End of every block of a send kernel. The block joins; thread 0 then issues one fence.acq_rel.sys
// and adds 1 (relaxed) to this rank's block counter in `slot` at every rank. Release is cumulative:
// the barrier orders every thread's peer stores before thread 0's fence, and the fence waits until
// they are performed at system scope (one NVLink round trip per block, one fence instead of one per
// warp). The block's rows are published without waiting for any other block. Then the block counts
// itself done locally; the last block of the grid (it has seen every block's count, so no block
// still reads the epoch) publishes `epoch` into epochs[epoch_index] for the receive kernel that
// follows in the stream and resets the local counter. Send kernels never wait, so it always resets.
__device__ __forceinline__ void finish_send_block(const Comm& c, int* done, int slot, int epoch_index,
                                                  unsigned long long epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    for (int d = 0; d < c.nranks; ++d) red_add_relaxed_sys(signal_at(c, d, slot, c.rank), 1);
    const int blocks = static_cast<int>(gridDim.x * gridDim.y);
    if (atomicAdd(done, 1) == blocks - 1) {
      c.epochs[epoch_index] = epoch;
      *done = 0;
    }
  }
}

// Every block of a receive kernel: thread 0 alone polls (relaxed) until each rank r's block counter
// in `slot` reaches `target`, fences once (acquire), and the block barrier hands the acquired data
// to all threads. One poller per block keeps the polls off the L2 slice that the peers' adds must
// reach. Returns false when a wait timed out (recorded in ErrorState with rank and phase); the block
// must then leave. With `count_slot` >= 0, tokens_out[r] gets the low 32 bits of rank r's entry
// there (stored by r before its release).
__device__ __forceinline__ bool wait_all_sources(const Comm& c, int slot, uint64_t target, int phase,
                                                 int count_slot, int* tokens_out, int* ok_shared) {
  if (threadIdx.x == 0) {
    int ok = 1;
    for (int r = 0; r < c.nranks && ok; ++r) ok = wait_relaxed_geq(c, signal_at(c, c.rank, slot, r), target, phase, r);
    fence_acq_rel_sys();
    if (ok && count_slot >= 0)
      for (int r = 0; r < c.nranks; ++r)
        tokens_out[r] = static_cast<int>(ld_relaxed_sys(signal_at(c, c.rank, count_slot, r)) & 0xffffffffu);
    *ok_shared = ok;
  }
  __syncthreads();
  return *ok_shared != 0;
}

}  // namespace ll
}  // namespace moe_ep
#endif  // __CUDACC__
