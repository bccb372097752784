// The NVFP4 cast of one kNvfp4Block-channel block (moe_ep/comm/nvfp4.py's recipe), one source for the
// dispatch kernel's send half and for its host run (nvfp4.cu), so that tests without a GPU check the very
// arithmetic the kernel does against moe_ep.comm.nvfp4.quantize:
//   amax  = max |x| (NaN ignored, as PTX max ignores it; NaN only when every value is NaN)
//   s     = g * (amax * (1/6))                                       (two products, each rounded)
//   scale = e4m3(s): NaN -> 0x7F; else cuda_fp8.h's __NV_SATFINITE conversion (nearest even, |s| beyond
//           448 -> +-448, the sign kept, also for -0)
//   out   = 0 if float(scale) == 0 else 1 / (float(scale) * (1/g))   (1/g: the caller's inv_g)
//   value = e2m1(x * out): nearest even, saturating at 6, the product's sign bit, NaN -> 0x7 (e2m1_code)
// Every step is float32 round-to-nearest-even with correctly rounded reciprocals: __fmul_rn / __frcp_rn on
// the device (no contraction into an FMA, no approximate reciprocal), IEEE binary32 * and / on the host.
#pragma once
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "kernels/low_latency/low_latency.h"

namespace moe_ep {
namespace ll {

// One block cast: 8 bytes of e2m1 pairs (channel 2i in the low nibble of byte i) and the e4m3 scale byte.
struct Nvfp4Block {
  uint2 values;
  uint8_t scale;
};

constexpr float kNvfp4InvE2m1Max = 1.0f / kNvfp4E2m1Max;  // 1/6 correctly rounded (constant evaluation)

__host__ __device__ __forceinline__ float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

__host__ __device__ __forceinline__ float rcp_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

// max(a, b) ignoring a NaN operand, quiet or signalling alike (NaN only when both are): PTX max.f32 on the
// device; a comparison on the host, whose fmaxf returns NaN for a signalling NaN (bf16 has them).
__host__ __device__ __forceinline__ float max_ignoring_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return b > a || a != a ? b : a;
#endif
}

// The e2m1 code of v as cvt.rn.satfinite.e2m1x2.f32 rounds (an sm_100a instruction; CUDA 12.8's cuda_fp4.h
// emulates it elsewhere, written out here so that every CUDA 12 and 13 toolkit builds it): the magnitude's
// nearest code over {0, 0.5, 1, 1.5, 2, 3, 4, 6}, a midpoint going to the even code, above 6 saturating at 6
// (code 7); bit 3 the sign bit of v, zero included; NaN -> 0x7.
__host__ __device__ __forceinline__ unsigned e2m1_code(float v) {
  const float m = fabsf(v);
  if (m != m) return 7u;
  // the rounding points at or below m; at the midpoints 0.25 (codes 0|1), 1.25 (2|3), 2.5 (4|5) and 5 (6|7)
  // m stays with the even code below, at 0.75 (1|2), 1.75 (3|4) and 3.5 (5|6) it goes to the even code above
  const unsigned code = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) + (m >= 3.5f) +
                        (m > 5.0f);
  return code | (signbit(v) ? 8u : 0u);
}

// x: the block's channels as float32 (exact from bf16); g the global scale, inv_g = rcp_rn(g).
__host__ __device__ __forceinline__ Nvfp4Block nvfp4_cast(const float (&x)[kNvfp4Block], float g, float inv_g) {
  float amax = fabsf(x[0]);
#pragma unroll
  for (int j = 1; j < kNvfp4Block; ++j) amax = max_ignoring_nan(amax, fabsf(x[j]));
  const float s = mul_rn(g, mul_rn(amax, kNvfp4InvE2m1Max));
  __nv_fp8_e4m3 scale;
  scale.__x = s != s ? static_cast<__nv_fp8_storage_t>(0x7F)  // NaN, whatever its sign bit
                     : __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
  const float stored = static_cast<float>(scale);
  const float out = stored == 0.0f ? 0.0f : rcp_rn(mul_rn(stored, inv_g));
  unsigned w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < kNvfp4Block; ++i) w[i / 8] |= e2m1_code(mul_rn(x[i], out)) << (4 * (i % 8));
  return Nvfp4Block{make_uint2(w[0], w[1]), scale.__x};
}

}  // namespace ll
}  // namespace moe_ep
