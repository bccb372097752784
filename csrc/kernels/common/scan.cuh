// Integer prefix sums over a warp and over a block, shared by every kernel folder: the cross-node
// route (positions of a rank's tokens) and notify (first output row of each source), the NVLink
// dispatch layout (per-rank scans of warp totals) and the low-latency dispatch receive (rows of a
// local expert). Integer adds in a fixed shape: the result does not depend on timing.
#pragma once
#include "kernels/common/warp.cuh"

namespace moe_ep {

// Inclusive prefix sum of `v` over the lanes of the calling warp (Kogge-Stone, 5 shuffles); every
// lane of the warp calls it.
__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int up = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

// Exclusive prefix sum of `v` over the block in thread order (blockDim.x a multiple of 32, at most
// 1024); *total gets the block's sum. Every thread of the block calls it. warp_sums: shared int[32].
// Two barriers inside: the warps' sums, then warp 0's scan of them. The caller must pass another
// barrier before it reuses warp_sums (a scan in a loop: one __syncthreads per iteration).
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int incl = warp_inclusive_scan(v, lane);
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) warp_sums[lane] = warp_inclusive_scan(lane < warps ? warp_sums[lane] : 0, lane);
  __syncthreads();
  *total = warp_sums[warps - 1];
  return (warp > 0 ? warp_sums[warp - 1] : 0) + incl - v;
}

}  // namespace moe_ep
