// The FP8 grouped GEMM of moe_ep.moe._gemm as the bindings (bindings.cpp) and any other host caller see it: one
// argument struct of raw device addresses and a stream, no CUTLASS and no torch types. What it computes, for
// rows grouped by expert (counts[e] rows for expert e, in expert order, counts on the device):
//   out[p, n] = bf16( sum_kb (a[p, kb] . b[e_p, n, kb]) * a_scale[p, kb] * b_scale[e_p, n / 128, kb] )
// with kb the 128-deep K blocks and the sum in float32 (DeepSeek-V3's block scales: one scale per row per 128
// channels of a, one per 128 x 128 block of b). The kernel itself is fp8_grouped_gemm_sm90.cuh (sm_90a only).
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe_ep {
namespace gemm {

constexpr int kScaleBlock = 128;  // K and N granularity of the scales, and of the shapes the kernel accepts

// The compiled kernels (fp8_grouped_gemm_sm90.cuh, one .cu each): CTA tile M x N x K, cluster, warpgroup
// schedule. Both give the same sums; only speed differs.
enum class TileConfig : int {
  kCooperative128 = 0,  // 128 x 128 x 128 tile, both consumer warpgroups on one tile, cluster 1 x 2 (A multicast)
  kPingpong64 = 1,      // 64 x 128 x 128 tile, the two consumer warpgroups on alternate tiles, cluster 1 x 2
};
constexpr int kNumTileConfigs = 2;

// Order in which the persistent CTAs walk one expert's output tiles.
enum class Raster : int {
  kAlongM = 0,  // consecutive CTAs take the M tiles of one column block of b (CUTLASS's default for groups)
  kAlongN = 1,  // consecutive CTAs take the N tiles of one row block of a
};
constexpr int kNumRasters = 2;

// One call. Every tensor is contiguous and row-major; addresses are device addresses (a, b and out 16-byte
// aligned, as TMA needs). Rows past sum(counts) are not written; counts past `rows` are clipped to it.
struct GroupedGemmArgs {
  uintptr_t a;          // [rows, k] float8 e4m3, grouped by expert
  uintptr_t a_scale;    // [rows, k / 128] float32
  uintptr_t b;          // [groups, n, k] float8 e4m3 (each expert's weight, K contiguous)
  uintptr_t b_scale;    // [groups, n / 128, k / 128] float32
  uintptr_t counts;     // [groups] int32, rows per expert, read on the device only
  uintptr_t out;        // [rows, n] bfloat16
  uintptr_t workspace;  // workspace_bytes(groups, config) bytes of device memory, 128-byte aligned
  int64_t workspace_bytes;
  int64_t rows;    // M, the upper bound of sum(counts)
  int64_t n;       // output columns, a positive multiple of 128
  int64_t k;       // reduction depth, a positive multiple of 128
  int64_t groups;  // E
  int64_t config;  // TileConfig
  int64_t raster;  // Raster
  uintptr_t stream;  // cudaStream_t both kernels run on
};

// Device memory one call with `groups` groups needs on the current device (the per-group tables the argument
// kernel writes, then CUTLASS's tensor-map workspace, one slot per SM).
size_t workspace_bytes(int64_t groups, int64_t config);

// Launches, on args.stream, the argument kernel (per-group shapes, addresses, strides and scale layouts from
// counts, on the device) and then the grouped GEMM. No host synchronisation. The bindings check the fields
// first; a CUTLASS refusal or a CUDA error raises std::runtime_error naming it.
void grouped_gemm(const GroupedGemmArgs& args);

// What those two dispatch to by args.config: one translation unit per TileConfig
// (fp8_grouped_gemm_sm90_<config>.cu, compiled in parallel; the kernel templates: fp8_grouped_gemm_sm90.cuh).
namespace sm90 {
size_t cooperative128_workspace_bytes(int64_t groups);
void cooperative128_run(const GroupedGemmArgs& args);
size_t pingpong64_workspace_bytes(int64_t groups);
void pingpong64_run(const GroupedGemmArgs& args);
}  // namespace sm90

}  // namespace gemm
}  // namespace moe_ep
