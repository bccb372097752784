// The FP8 grouped GEMMs of moe_ep.moe._gemm as the bindings (bindings.cpp) and any other host caller see them: one
// argument struct of raw device addresses and a stream per GEMM, no CUTLASS and no torch types. Both take the
// group sizes as counts on the device only (no host synchronisation), sum in float32 and round once to bf16
// (round to nearest even), with DeepSeek-V3's block scales. The kernels are fp8_grouped_gemm_sm90.cuh (sm_90a only).
//
// grouped_gemm (the forward and data-gradient GEMMs), rows grouped by expert (counts[e] rows for expert e, in
// expert order):
//   out[p, n] = bf16( sum_kb (a[p, kb] . b[e_p, n, kb]) * a_scale[p, kb] * b_scale[e_p, n / 128, kb] )
// with kb the 128-deep K blocks (one scale per row per 128 channels of a, one per 128 x 128 block of b).
//
// wgrad_gemm (the weight gradient), the reduction dimension grouped by expert ("K-grouped": group e's tokens are
// the columns [c_e, c_e + counts[e]) of a and b, transposed operands as moe_ep.moe.fp8_wgrad quantizes them):
//   out[e, i, j] = bf16( sum_kb (a[i, kb] . b[j, kb]) * a_scale_e[i, kb] * b_scale_e[j, kb] )
// with kb the 128-token blocks of group e (the last one may be partial) and one scale per row of a and of b per
// block (1 x 128 along the tokens); a group without tokens gets out[e] = 0.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe_ep {
namespace gemm {

constexpr int kScaleBlock = 128;  // K and N granularity of the scales, and of the shapes the kernel accepts
constexpr int kGroupColumnAlign = 16;  // wgrad_gemm: each group's first column (TMA's 16-byte aligned e4m3 start)

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

// The compiled weight-gradient kernels (a TileConfig family of their own: their scales are per row of a and of b).
enum class WgradTileConfig : int {
  kWgradCooperative128 = 0,  // 128 x 128 x 128 tile, both consumer warpgroups on one tile, cluster 1 x 2
};
constexpr int kNumWgradTileConfigs = 1;
constexpr int kMaxWgradGroups = 65535;  // one grid row per group in the kernel that zeros empty groups' outputs

// One weight-gradient call (K-grouped; what it computes: the top of this file). Addresses are device addresses
// (a, b and out 16-byte aligned, as TMA needs). The placement of group e, from the counts clipped so that their
// running sum never passes `tokens` (a negative count counts as 0) and n_e the clipped count:
//   columns  c_e = sum_{e' < e} roundup(n_e', 16)        scale blocks  s_e = sum_{e' < e} ceil(n_e' / 128)
//   a[:, c_e + t], b[:, c_e + t]  its token t (t < n_e; columns past n_e are not read: TMA fills zeros)
//   a_scale[m * s_e + i * kb_e + blk], b_scale[n * s_e + j * kb_e + blk]  (group e's [m, kb_e] and [n, kb_e]
//   blocks, row-major, kb_e = ceil(n_e / 128))
//   out[e]  [m, n] row-major at out + e * m * n; zeros when n_e = 0.
struct WgradGemmArgs {
  uintptr_t a;          // [m, columns] float8 e4m3 (dy^T: rows m, tokens along columns)
  uintptr_t a_scale;    // float32, at least m * (tokens / 128 + groups) of them
  uintptr_t b;          // [n, columns] float8 e4m3 (x^T)
  uintptr_t b_scale;    // float32, at least n * (tokens / 128 + groups) of them
  uintptr_t counts;     // [groups] int32, tokens per group, read on the device only
  uintptr_t out;        // [groups, m, n] bfloat16, every element written
  uintptr_t workspace;  // wgrad_workspace_bytes(groups, config) bytes of device memory, 128-byte aligned
  int64_t workspace_bytes;
  int64_t m;        // rows of a and of each out[e], positive
  int64_t n;        // rows of b, columns of each out[e]: a positive multiple of 8 (16-byte bf16 rows)
  int64_t tokens;   // the upper bound of sum(counts) (the rows the operands were quantized from)
  int64_t columns;  // row stride of a and b: a multiple of 16, at least tokens + 15 * groups
  int64_t groups;   // E, at most kMaxWgradGroups
  int64_t config;   // WgradTileConfig
  int64_t raster;   // Raster
  uintptr_t stream;  // cudaStream_t the kernels run on
};

// Device memory one weight-gradient call with `groups` groups needs on the current device.
size_t wgrad_workspace_bytes(int64_t groups, int64_t config);

// Launches, on args.stream, the argument kernel (per-group tables from counts), a kernel that zeros out[e] of the
// groups without tokens, and the grouped GEMM over the others. No host synchronisation; errors as grouped_gemm's.
void wgrad_gemm(const WgradGemmArgs& args);

// What those dispatch to by args.config: one translation unit per TileConfig
// (fp8_grouped_gemm_sm90_<config>.cu, compiled in parallel; the kernel templates: fp8_grouped_gemm_sm90.cuh).
namespace sm90 {
size_t cooperative128_workspace_bytes(int64_t groups);
void cooperative128_run(const GroupedGemmArgs& args);
size_t pingpong64_workspace_bytes(int64_t groups);
void pingpong64_run(const GroupedGemmArgs& args);
size_t wgrad_cooperative128_workspace_bytes(int64_t groups);
void wgrad_cooperative128_run(const WgradGemmArgs& args);
}  // namespace sm90

}  // namespace gemm
}  // namespace moe_ep
