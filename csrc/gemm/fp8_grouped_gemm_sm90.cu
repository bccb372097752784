// The FP8 grouped GEMM's entry points (fp8_grouped_gemm.h): each picks the compiled kernel of args.config, one
// translation unit per TileConfig (fp8_grouped_gemm_sm90_<config>.cu; the templates: fp8_grouped_gemm_sm90.cuh),
// so this one needs no CUTLASS header.
#include <stdexcept>
#include <string>

#include "gemm/fp8_grouped_gemm.h"

namespace moe_ep {
namespace gemm {

size_t workspace_bytes(int64_t groups, int64_t config) {
  switch (static_cast<TileConfig>(config)) {
    case TileConfig::kCooperative128:
      return sm90::cooperative128_workspace_bytes(groups);
    case TileConfig::kPingpong64:
      return sm90::pingpong64_workspace_bytes(groups);
  }
  throw std::invalid_argument("fp8_grouped_gemm: config = " + std::to_string(config) + ", expected 0.." +
                              std::to_string(kNumTileConfigs - 1));
}

void grouped_gemm(const GroupedGemmArgs& args) {
  switch (static_cast<TileConfig>(args.config)) {
    case TileConfig::kCooperative128:
      return sm90::cooperative128_run(args);
    case TileConfig::kPingpong64:
      return sm90::pingpong64_run(args);
  }
  throw std::invalid_argument("fp8_grouped_gemm: config = " + std::to_string(args.config) + ", expected 0.." +
                              std::to_string(kNumTileConfigs - 1));
}

}  // namespace gemm
}  // namespace moe_ep
