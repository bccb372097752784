// The dispatch layout of a slice of tokens [begin, end), computed by one block of kLayoutThreads
// threads: the device code that layout.cu (get_dispatch_layout: one block, every token) and notify.cu
// (one slice per block, then the count exchange) inline. Both kernels are templates on kK, a
// compile-time bound on K (8 or 16), so per-token loops over the top-k entries are unrolled without
// issuing dead predicated iterations for K <= 8.
// Every thread of the block calls layout_counts, then (when pos is wanted) layout_positions; each
// ends with a barrier, after which its outputs are visible to the whole block.
//  1. layout_counts: each thread first prefetches (into L2) the topk rows of all its tokens, so later
//     steps find them there. Then kExpertChunk experts at a time: the block zeroes a shared-memory
//     counter per expert of the chunk; thread t owns tokens begin + t, begin + t + kLayoutThreads, ...; it loads its
//     token's ids (16-byte loads when K is even), adds 1 (shared atomics) for each expert named for
//     the first time in the row (a token naming an expert twice counts once), and in the first chunk
//     also builds the token's rank bitmask (expert -> rank by comparisons, no division), writes
//     is_token_in_rank, and per rank a warp ballot whose popcount lane 0 adds to a shared counter.
//     One chunk covers E <= kExpertChunk; larger E repeats the pass per chunk. The slice's counts per
//     expert are stored, or with kAccumulate added (global atomics, nonzero counts only) into totals
//     that several blocks share; its counts per rank are stored.
//  2. layout_positions: kLayoutThreads tokens per step from `begin`, thread t owning token step + t,
//     each rank's count starting at slice_base[r] (the tokens of earlier slices that go to r): each thread
//     rebuilds its token's rank bitmask from is_token_in_rank (written by this block in step 1, so
//     visible after its barrier; no topk reload); per rank, a warp ballot gives the token's offset
//     inside its warp and the warp's total; warp r then scans rank r's totals over the 32 warps
//     (adding the running total `carry[r]` of earlier steps), and every thread writes
//     pos = carry + warp offset + lane offset. Barriers separate the ballot, the scan and the reads
//     of its result, so each step's shared arrays are reused safely.
#pragma once
#include "kernels/common/scan.cuh"
#include "kernels/common/warp.cuh"
#include "kernels/intranode/intranode.h"
#include "runtime/comm.h"

namespace moe_ep {
namespace intranode {

constexpr int kLayoutThreads = 1024;
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
      for (int q = 1; q < kMaxNodeRanks; ++q) r += (q < nranks && id[k] >= q * num_local) ? 1 : 0;
      if (id[k] >= 0) mask |= 1u << r;
    }
    return mask;
  }
};

template <int kK, bool kAccumulate = false>
__device__ __forceinline__ void layout_counts(const LayoutArgs& a, int begin, int end, int num_topk, int num_experts,
                                              int nranks, ErrorState* error) {
  __shared__ int expert_count[kExpertChunk];
  __shared__ int rank_count[kMaxNodeRanks];

  const int tid = threadIdx.x, lane = tid % 32;
  const int num_local = num_experts / nranks;
  const auto* topk_idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  auto* tokens_per_expert = reinterpret_cast<int*>(a.tokens_per_expert);
  auto* in_rank = reinterpret_cast<bool*>(a.is_token_in_rank);

  for (int n = begin + tid; n < end; n += kLayoutThreads)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(topk_idx + (size_t)n * num_topk));
  if (tid < kMaxNodeRanks) rank_count[tid] = 0;
  for (int e0 = 0; e0 < num_experts; e0 += kExpertChunk) {
    const int width = min(kExpertChunk, num_experts - e0);
    for (int i = tid; i < width; i += kLayoutThreads) expert_count[i] = 0;
    __syncthreads();
    for (int step = begin; step < end; step += kLayoutThreads) {
      const int n = step + tid;
      unsigned ranks = 0;
      if (n < end) {
        const TokenExperts<kK> t(topk_idx, n, num_topk, num_experts, error);
#pragma unroll
        for (int k = 0; k < kK; ++k) {
          const int e = t.id[k] - e0;  // -1 entries land below 0
          if (e >= 0 && e < width && t.first(k)) atomicAdd(&expert_count[e], 1);
        }
        if (e0 == 0) {
          ranks = t.ranks(num_local, nranks);
#pragma unroll
          for (int r = 0; r < kMaxNodeRanks; ++r)
            if (r < nranks) in_rank[(size_t)n * nranks + r] = (ranks >> r) & 1u;
        }
      }
      if (e0 == 0) {
#pragma unroll
        for (int r = 0; r < kMaxNodeRanks; ++r) {
          if (r >= nranks) break;
          const unsigned votes = __ballot_sync(kFullMask, (ranks >> r) & 1u);
          if (lane == 0 && votes != 0) atomicAdd(&rank_count[r], __popc(votes));
        }
      }
    }
    __syncthreads();
    for (int i = tid; i < width; i += kLayoutThreads) {
      if (!kAccumulate)
        tokens_per_expert[e0 + i] = expert_count[i];
      else if (expert_count[i] != 0)
        atomicAdd(tokens_per_expert + e0 + i, expert_count[i]);
    }
    __syncthreads();
  }
  if (tid < nranks) reinterpret_cast<int*>(a.tokens_per_rank)[tid] = rank_count[tid];
  __syncthreads();
}

__device__ __forceinline__ void layout_positions(const LayoutArgs& a, int begin, int end, const int* slice_base, int nranks) {
  __shared__ int warp_total[kLayoutWarps][kMaxNodeRanks];
  __shared__ int warp_first[kLayoutWarps][kMaxNodeRanks];
  __shared__ int carry[kMaxNodeRanks];

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const auto* in_rank = reinterpret_cast<const bool*>(a.is_token_in_rank);
  auto* pos = reinterpret_cast<int*>(a.pos);
  __syncthreads();  // slice_base may be this block's shared memory, written just before
  if (tid < nranks) carry[tid] = slice_base[tid];  // read by the scan below after the loop's first barrier
  for (int step = begin; step < end; step += kLayoutThreads) {
    const int n = step + tid;
    unsigned ranks = 0;
    if (n < end) {
#pragma unroll
      for (int r = 0; r < kMaxNodeRanks; ++r)
        if (r < nranks && in_rank[(size_t)n * nranks + r]) ranks |= 1u << r;
    }
    int before[kMaxNodeRanks];  // tokens of lower lanes of this warp that go to rank r
#pragma unroll
    for (int r = 0; r < kMaxNodeRanks; ++r) {
      const unsigned votes = __ballot_sync(kFullMask, (ranks >> r) & 1u);
      before[r] = __popc(votes & ((1u << lane) - 1u));
      if (lane == 0 && r < nranks) warp_total[warp][r] = __popc(votes);
    }
    __syncthreads();
    if (warp < nranks) {  // warp r: exclusive scan of rank r's warp totals, plus the carry
      const int r = warp;
      const int mine = warp_total[lane][r];
      const int inclusive = warp_inclusive_scan(mine, lane);
      const int base = carry[r];
      warp_first[lane][r] = base + inclusive - mine;
      __syncwarp();
      if (lane == 31) carry[r] = base + inclusive;
    }
    __syncthreads();
    if (n < end) {
#pragma unroll
      for (int r = 0; r < kMaxNodeRanks; ++r) {
        if (r >= nranks) break;
        pos[(size_t)n * nranks + r] = (ranks >> r) & 1u ? warp_first[warp][r] + before[r] : -1;
      }
    }
  }
  __syncthreads();
}

}  // namespace intranode
}  // namespace moe_ep
