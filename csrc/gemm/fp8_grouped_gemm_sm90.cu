// The FP8 grouped GEMMs' entry points (fp8_grouped_gemm.h): each picks the compiled kernel of args.config, one
// translation unit per TileConfig (fp8_grouped_gemm_sm90_<config>.cu; the templates: fp8_grouped_gemm_sm90.cuh),
// so this one needs no CUTLASS header.
#include <stdexcept>
#include <string>

#include "gemm/fp8_grouped_gemm.h"

namespace moe_ep {
namespace gemm {
namespace {

[[noreturn]] void bad_config(const char* where, int64_t config, int configs) {
  throw std::invalid_argument(std::string(where) + ": config = " + std::to_string(config) + ", expected 0.." +
                              std::to_string(configs - 1));
}

}  // namespace

size_t workspace_bytes(int64_t groups, int64_t config) {
  switch (static_cast<TileConfig>(config)) {
    case TileConfig::kCooperative128:
      return sm90::cooperative128_workspace_bytes(groups);
    case TileConfig::kPingpong64:
      return sm90::pingpong64_workspace_bytes(groups);
  }
  bad_config("fp8_grouped_gemm", config, kNumTileConfigs);
}

void grouped_gemm(const GroupedGemmArgs& args) {
  switch (static_cast<TileConfig>(args.config)) {
    case TileConfig::kCooperative128:
      return sm90::cooperative128_run(args);
    case TileConfig::kPingpong64:
      return sm90::pingpong64_run(args);
  }
  bad_config("fp8_grouped_gemm", args.config, kNumTileConfigs);
}

size_t wgrad_workspace_bytes(int64_t groups, int64_t config) {
  switch (static_cast<WgradTileConfig>(config)) {
    case WgradTileConfig::kWgradCooperative128:
      return sm90::wgrad_cooperative128_workspace_bytes(groups);
  }
  bad_config("fp8_wgrad_gemm", config, kNumWgradTileConfigs);
}

void wgrad_gemm(const WgradGemmArgs& args) {
  switch (static_cast<WgradTileConfig>(args.config)) {
    case WgradTileConfig::kWgradCooperative128:
      return sm90::wgrad_cooperative128_run(args);
  }
  bad_config("fp8_wgrad_gemm", args.config, kNumWgradTileConfigs);
}

}  // namespace gemm
}  // namespace moe_ep
