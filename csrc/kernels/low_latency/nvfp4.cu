// nvfp4_cast_host (low_latency.h): the dispatch kernel's NVFP4 cast (nvfp4.cuh) over host rows, for
// checks on machines without a GPU. Compiled by nvcc for the host; no device code runs.
#include <cstring>

#include "kernels/low_latency/low_latency.h"
#include "kernels/low_latency/nvfp4.cuh"

namespace moe_ep {
namespace ll {

void nvfp4_cast_host(const Nvfp4HostCastArgs& a) {
  const auto* x = reinterpret_cast<const uint16_t*>(a.x);
  auto* values = reinterpret_cast<uint8_t*>(a.values);
  auto* scales = reinterpret_cast<uint8_t*>(a.scales);
  const int blocks = a.hidden / kNvfp4Block;
  const float inv_g = rcp_rn(a.global_scale);
  for (size_t b = 0; b < static_cast<size_t>(a.num_rows) * blocks; ++b) {
    float f[kNvfp4Block];
    for (int j = 0; j < kNvfp4Block; ++j) {
      const uint32_t bits = static_cast<uint32_t>(x[b * kNvfp4Block + j]) << 16;  // bf16 -> float32, exact
      std::memcpy(&f[j], &bits, sizeof(float));
    }
    const Nvfp4Block q = nvfp4_cast(f, a.global_scale, inv_g);
    std::memcpy(values + b * sizeof(uint2), &q.values, sizeof(uint2));  // host memory: no alignment promised
    scales[b] = q.scale;
  }
}

}  // namespace ll
}  // namespace moe_ep
