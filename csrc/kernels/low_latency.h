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
  int blocks_per_expert;            // P: blocks sharing one local expert in the per-expert kernels
};

// Dispatch send half: quantise (optionally) and push every token to each rank holding one of its
// experts, then release per-source flags. x [N, H] bf16, topk_idx [N, K] int64.
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

// Signal slots (8..11 of comm.h's low-latency range) and epoch counters of the two protocols.
// A call with epoch e uses buffer set e & 1 and signal slot base + (e & 1).
constexpr int kSigDispatch = kSigLowLatencyFirst;       // 8, 9: dispatch rows + token count landed
constexpr int kSigCombine = kSigLowLatencyFirst + 2;    // 10, 11: combine rows landed
constexpr int kEpochDispatch = kSigLowLatencyFirst;     // epochs[8]: last dispatch epoch sent
constexpr int kEpochCombine = kSigLowLatencyFirst + 2;  // epochs[10]: last combine epoch sent

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

// One warp copies n int4 from src to dst, 8 loads in flight per lane before the stores.
__device__ __forceinline__ void warp_copy_int4(int4* dst, const int4* src, int n, int lane) {
  constexpr int kUnroll = 8;
  for (int base = 0; base < n; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < n) dst[i] = v[u];
    }
  }
}

// End of a send kernel. Every thread fences its peer stores at system scope, then the block counts
// itself done; the last block of the grid (which has thereby observed every other block's fenced
// stores: fence + atomic on their side, atomic + fence on its side) releases `flag_value` into slot
// `slot` at every rank, publishes the epoch for the receive kernel that follows in the stream, and
// resets the counter for the next launch. Send kernels never wait, so the counter always resets.
__device__ __forceinline__ void finish_send(const Comm& c, int* done, int slot, uint64_t flag_value,
                                            int epoch_index, unsigned long long epoch) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int blocks = static_cast<int>(gridDim.x * gridDim.y);
    if (atomicAdd(done, 1) == blocks - 1) {
      __threadfence_system();
      for (int d = 0; d < c.nranks; ++d) st_release_sys(signal_at(c, d, slot, c.rank), flag_value);
      c.epochs[epoch_index] = epoch;
      *done = 0;
    }
  }
}

// Every block of a receive kernel: threads r < nranks wait until rank r's flag in `slot` reaches
// `target` (acquire), then the block barrier hands the acquired data to all threads. Returns false
// when a wait timed out (recorded in ErrorState with rank and phase); the block must then leave.
// `flags_out` (shared, may be null) receives each source's flag value.
__device__ __forceinline__ bool wait_all_sources(const Comm& c, int slot, uint64_t target, int phase,
                                                 uint64_t* flags_out, int* ok_shared) {
  if (threadIdx.x == 0) *ok_shared = 1;
  __syncthreads();
  if (threadIdx.x < c.nranks) {
    const uint64_t* flag = signal_at(c, c.rank, slot, static_cast<int>(threadIdx.x));
    if (wait_geq(c, flag, target, phase, static_cast<int>(threadIdx.x))) {
      if (flags_out != nullptr) flags_out[threadIdx.x] = ld_acquire_sys(flag);
    } else {
      *ok_shared = 0;
    }
  }
  __syncthreads();
  return *ok_shared != 0;
}

}  // namespace ll
}  // namespace moe_ep
#endif  // __CUDACC__
