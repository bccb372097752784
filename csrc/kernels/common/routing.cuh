// How every normal-mode dispatch path (NVLink and cross-node) reads a token's routing: one lane per
// top-k entry, the expert id checked against [-1, E) (comm.h checked_expert); and the output rows it
// writes that hold no token: worst-case padding, and the poison over the rows of a call that gave up.
#pragma once
#include <cstddef>
#include <cstdint>

#include "runtime/comm.h"

namespace moe_ep {

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

// What fill_dispatch_rows writes.
enum class RowFill {
  kPadding,  // worst-case rows no source fills: zero x and scales, topk_idx -1, weights 0, src_rank / src_index -1
  kPoison,   // rows of a call whose wait gave up: NaN x (bf16 0x7fc0, FP8 e4m3 0x7f bytes), NaN scales,
             // topk_idx -1, NaN weights, src_rank / src_index -1, so nothing downstream takes them for results
};

// Output rows [row, row + count) of a normal-mode dispatch (either path's DispatchArgs: out_x,
// out_scales, out_topk_idx, out_topk_weights, out_src_rank, out_src_index, row_bytes, num_scales,
// cached) set to `fill`, by threads start, start + stride, ... of the caller (a warp: lane, 32; a
// block: threadIdx.x, blockDim.x). A cached dispatch writes no topk, src_rank or src_index (their
// pointers are 0): only x and scales.
template <class Args>
__device__ __forceinline__ void fill_dispatch_rows(const Args& a, int num_topk, size_t row, size_t count, RowFill fill,
                                                   int start, int stride) {
  const bool poison = fill == RowFill::kPoison;
  const int K = num_topk, S = a.num_scales;  // S > 0: FP8 rows
  if (!a.cached) {
    long long* topk = reinterpret_cast<long long*>(a.out_topk_idx) + row * K;
    float* weights = reinterpret_cast<float*>(a.out_topk_weights) + row * K;
    const float w = poison ? f32_nan() : 0.f;
    for (size_t e = start; e < count * K; e += stride) {
      topk[e] = -1;
      weights[e] = w;
    }
    for (size_t e = start; e < count; e += stride) {
      reinterpret_cast<int*>(a.out_src_rank)[row + e] = -1;
      reinterpret_cast<int*>(a.out_src_index)[row + e] = -1;
    }
  }
  const float scale = poison ? f32_nan() : 0.f;
  for (size_t e = start; e < count * S; e += stride) reinterpret_cast<float*>(a.out_scales)[row * S + e] = scale;
  if (a.out_x == 0) return;  // an NVLink dispatch whose rows stay in the workspace (expand.cu poisons its pairs)
  const int4 v = !poison ? make_int4(0, 0, 0, 0) : S > 0 ? e4m3_nan_x16() : bf16_nan_x8();
  int4* x = reinterpret_cast<int4*>(reinterpret_cast<char*>(a.out_x) + row * a.row_bytes);
  for (size_t e = start; e < count * (a.row_bytes / 16); e += stride) x[e] = v;
}

}  // namespace moe_ep
