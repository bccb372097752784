// How every normal-mode dispatch path (NVLink and cross-node) reads a token's routing: one lane per
// top-k entry, the expert id checked against [-1, E) (comm.h checked_expert).
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

}  // namespace moe_ep
