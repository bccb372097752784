// The combine arithmetic of every normal-mode path (NVLink and cross-node): bf16 rows accumulated in
// float32 with __fadd_rn (never contracted) and rounded back to bf16 once, and the float32 sums of
// the router weights, never rounded. Sums run in a fixed order, so results are bitwise reproducible.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace moe_ep {

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

}  // namespace moe_ep
