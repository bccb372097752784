// FP8 grouped GEMMs with DeepSeek-V3 block scales on Hopper (sm_90a), built from CUTLASS's pointer-array
// grouped GEMM with software block scaling (KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise):
// grouped_gemm (rows grouped by expert) and wgrad_gemm (the reduction dimension grouped by expert).
//
// What runs where, per call (fp8_grouped_gemm.h states the arithmetic):
//   host    picks the compiled kernel (TileConfig / WgradTileConfig), fills CUTLASS's Arguments with the device
//           addresses of the per-group tables (no group sizes: the host problem shapes are null) and encodes
//           the TMA descriptor templates (driver calls, no synchronisation);
//   device  1. write_group_tables (group_tables.cuh): one block turns counts into each group's shape,
//              addresses, strides and scale layouts (RowGrouped or KGrouped placement);
//           2. wgrad only: zero_empty_groups (group_tables.cuh) zeros out[e] of the groups without tokens,
//              which the tables give M = 0 (CUTLASS with K = 0 would store unset accumulators);
//           3. the persistent grouped GEMM, one CTA (or cluster of two) per SM: a producer warp loads A and B
//              tiles by TMA (descriptors patched in shared memory whenever the group changes; past the group's
//              M, N or K they read zeros) and another the scales by cp.async (predicated on the scale layout's
//              shape); the consumer warpgroups run WGMMA over each 128-deep K block, multiply that block's
//              float32 partial sums by a_scale[row] * b_scale[column or column block] and add them to the
//              float32 accumulators; the epilogue rounds to bf16 (round to nearest even) and stores by TMA,
//              clipped to the group's rows and columns.
// This header holds the kernel templates; each TileConfig is compiled in a translation unit of its own
// (fp8_grouped_gemm_sm90_<config>.cu, so nvcc builds them in parallel) and fp8_grouped_gemm_sm90.cu picks one.
// Relies on: grouped_gemm: K and N multiples of 128 (one scale per K block, one b scale per 128-column tile);
// wgrad_gemm: each group's K any (a partial last 128-token block reads zeros past K, and its scale index
// ceil(K / 128) - 1 is in the scale layout), group starts 16 elements apart and row strides multiples of 16
// (TMA's 16-byte rule), n a multiple of 8; both: a, b and out 16-byte aligned (TMA), M, N, K < 2^31 (CUTLASS's
// int problem shape), the workspace from workspace_bytes / wgrad_workspace_bytes on the same device. Scales are
// K-major (a_scale [rows, K blocks] row-major is that layout as is, each group's slice at its first row), so no
// transpose runs. C is not read (ElementC void).
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "gemm/fp8_grouped_gemm.h"
#include "gemm/group_tables.cuh"
#include "runtime/error_check.h"

#if !defined(CUTLASS_ARCH_MMA_SM90A_ENABLED) && defined(__CUDA_ARCH__)
#error "the sm90 FP8 grouped GEMM needs the sm_90a target (-gencode arch=compute_90a,code=sm_90a): WGMMA"
#endif

namespace moe_ep {
namespace gemm {
namespace sm90 {

using namespace cute;

// One compiled grouped GEMM: CTA tile, cluster, the mainloop / epilogue schedules, and how many columns of B
// (rows of the [N, K] operand) share one scale per 128-deep K block: 128 (a weight's 128 x 128 blocks) or 1
// (an activation's rows, the weight gradient's B).
template <class Tile, class Cluster, class MainloopSchedule, class EpilogueSchedule, int ScaleColumnsB = kScaleBlock>
struct GemmOf {
  using ElementAB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group

  // a_scale: one scale per row per 128 K (granularity 1 x 128), b_scale one per ScaleColumnsB columns per 128 K;
  // both K-major (each row's or column block's K blocks contiguous).
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, ScaleColumnsB, kScaleBlock, GMMA::Major::K,
                                                                GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  static constexpr int kAlignAB = 16;  // elements per 16-byte TMA access
  static constexpr int kAlignD = 8;

  // D = bf16(accumulator): no alpha, no beta, no C.
  using StoreAccumulator = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, ElementD, float,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor*, kAlignD,
      ElementD, cutlass::layout::RowMajor*, kAlignD, EpilogueSchedule, StoreAccumulator>::CollectiveOp;

  // A row-major [M, K]; B "column-major" K x N, i.e. each expert's [N, K] weight with K contiguous.
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
      cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>, kAlignAB, ElementAB,
      cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  static_assert(std::is_same_v<StrideA, Stride<int64_t, _1, _0>>, "A: rows apart by a row stride, K contiguous");
  static_assert(std::is_same_v<StrideB, Stride<int64_t, _1, _0>>, "B: columns (N) apart by a stride, K contiguous");
  static_assert(std::is_same_v<StrideD, Stride<int64_t, _1, _0>>, "D: rows n elements apart, N contiguous");
  static_assert(std::is_same_v<typename Kernel::InternalStrideC, StrideD>, "C shares D's stride table");
  static_assert(std::is_same_v<typename Mainloop::InternalLayoutSFA, LayoutSFA> &&
                    std::is_same_v<typename Mainloop::InternalLayoutSFB, LayoutSFB>,
                "the mainloop reads the scale layouts the tables hold");

  __device__ static StrideA row_stride_a(int64_t elements) { return make_stride(elements, _1{}, _0{}); }
  __device__ static StrideB row_stride_b(int64_t elements) { return make_stride(elements, _1{}, _0{}); }
  __device__ static StrideD row_stride_d(int64_t elements) { return make_stride(elements, _1{}, _0{}); }
};

using Cooperative128 =
    GemmOf<Shape<_128, _128, _128>, Shape<_1, _2, _1>,
           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
           cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
using Pingpong64 = GemmOf<Shape<_64, _128, _128>, Shape<_1, _2, _1>,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
// The weight gradient: Cooperative128's tile and schedule, one scale per row of A and per column of B per
// 128-token block (Sm90BlockwiseScaleConfig<1, 1, 128>: the mainloop's ScaleMsPerTile = ScaleNsPerTile = 128 path,
// which scales each accumulator by its row's a scale times its column's b scale).
using WgradCooperative128 =
    GemmOf<Shape<_128, _128, _128>, Shape<_1, _2, _1>,
           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
           cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, 1>;

// SM count and the most clusters of this kernel that fit at once, per device, queried once (the occupancy
// query needs the kernel's shared-memory size set first).
template <class G>
cutlass::KernelHardwareInfo hardware_info() {
  static std::mutex mutex;
  static std::unordered_map<int, cutlass::KernelHardwareInfo> known;
  int device = 0;
  MOE_EP_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find(device);
  if (found != known.end()) return found->second;
  cutlass::KernelHardwareInfo info;
  info.device_id = device;
  MOE_EP_CUDA_CHECK(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device));
  MOE_EP_CUDA_CHECK(cudaFuncSetAttribute(cutlass::device_kernel<typename G::Kernel>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         G::Kernel::SharedStorageSize));
  info.max_active_clusters = cutlass::KernelHardwareInfo::query_device_max_active_clusters<typename G::Kernel>();
  cudaGetLastError();  // a failed occupancy query leaves 0 (CUTLASS then sizes the grid from the SM count)
  known.emplace(device, info);
  return info;
}

template <class G>
typename G::Gemm::Arguments gemm_arguments(const GroupTables<G>& t, int64_t groups, Raster raster) {
  typename G::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(groups), t.shapes, nullptr};  // shapes on the device only
  args.mainloop = {t.a, t.stride_a, t.b, t.stride_b, t.a_scale, t.layout_a_scale, t.b_scale, t.layout_b_scale};
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = t.stride_out;
  args.epilogue.ptr_D = t.out;
  args.epilogue.dD = t.stride_out;
  args.hw_info = hardware_info<G>();
  args.scheduler.raster_order = raster == Raster::kAlongN
                                    ? cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN
                                    : cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM;
  return args;
}

inline void check_status(cutlass::Status status, const char* step) {
  if (status == cutlass::Status::kSuccess) return;
  cudaGetLastError();
  throw std::runtime_error(std::string("moe_ep: fp8 grouped GEMM (CUTLASS) ") + step + " failed: " +
                           cutlassGetStatusString(status));
}

template <class G>
size_t workspace_bytes_of(int64_t groups) {
  const GroupTables<G> none{};
  return align_up(GroupTables<G>::bytes(groups)) +
         G::Gemm::get_workspace_size(gemm_arguments<G>(none, groups, Raster::kAlongM));
}

// Checks the workspace of one call (`args`: GroupedGemmArgs or WgradGemmArgs; `where` names the entry point in
// the error), carves its tables and launches write_group_tables on `stream` with `layout`'s placement of the
// counts clipped to `bound` items in all.
template <class G, class Args, class Layout>
GroupTables<G> write_tables(const char* where, const Args& args, int64_t bound, Layout layout, cudaStream_t stream) {
  const size_t need = workspace_bytes_of<G>(args.groups);
  if (static_cast<size_t>(args.workspace_bytes) < need)
    throw std::invalid_argument(std::string(where) + ": workspace_bytes = " + std::to_string(args.workspace_bytes) +
                                ", this device and config need " + std::to_string(need));
  const GroupTables<G> tables = GroupTables<G>::carve(args.workspace, args.groups);
  const GroupCounts counts{reinterpret_cast<const int32_t*>(args.counts), args.groups, bound};
  const Operands base{args.a, args.a_scale, args.b, args.b_scale, args.out};
  write_group_tables<G, Layout><<<1, kTableThreads, 0, stream>>>(tables, counts, base, layout);
  MOE_EP_CUDA_CHECK(cudaGetLastError());
  return tables;
}

// Launches the grouped GEMM over `tables` (written by write_tables from args.workspace) on `stream`.
template <class G, class Args>
void launch_gemm(const GroupTables<G>& tables, const Args& args, cudaStream_t stream) {
  void* cutlass_workspace = reinterpret_cast<void*>(args.workspace + align_up(GroupTables<G>::bytes(args.groups)));
  const auto arguments = gemm_arguments<G>(tables, args.groups, static_cast<Raster>(args.raster));
  typename G::Gemm gemm;
  check_status(gemm.can_implement(arguments), "can_implement");
  check_status(gemm.initialize(arguments, cutlass_workspace, stream), "initialize");
  check_status(gemm.run(stream), "launch");
  MOE_EP_CUDA_CHECK(cudaGetLastError());
}

template <class G>
void run(const GroupedGemmArgs& args) {
  const auto stream = reinterpret_cast<cudaStream_t>(args.stream);
  launch_gemm<G>(write_tables<G>("fp8_grouped_gemm", args, args.rows, RowGrouped{args.n, args.k}, stream), args,
                 stream);
}

// Blocks per group of zero_empty_groups: enough for the output of a group, at most ~1024 blocks in all.
inline unsigned zero_blocks_per_group(int64_t group_elements, int64_t groups) {
  const int64_t vectors = (group_elements + 7) / 8;
  const int64_t needed = (vectors + kZeroThreads - 1) / kZeroThreads;
  const int64_t cap = 1024 / groups > 1 ? 1024 / groups : 1;
  return static_cast<unsigned>(needed < cap ? (needed > 0 ? needed : 1) : cap);
}

template <class G>
void run(const WgradGemmArgs& args) {
  const auto stream = reinterpret_cast<cudaStream_t>(args.stream);
  const auto tables =
      write_tables<G>("fp8_wgrad_gemm", args, args.tokens, KGrouped{args.m, args.n, args.columns}, stream);
  const int64_t group_elements = args.m * args.n;
  const dim3 grid(zero_blocks_per_group(group_elements, args.groups), static_cast<unsigned>(args.groups));
  zero_empty_groups<G><<<grid, kZeroThreads, 0, stream>>>(tables.shapes, args.out, group_elements);
  MOE_EP_CUDA_CHECK(cudaGetLastError());
  launch_gemm<G>(tables, args, stream);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace moe_ep

// The two entry points of one TileConfig (fp8_grouped_gemm.h), for its translation unit to define at global scope:
// MOE_EP_SM90_GEMM_ENTRY_POINTS(cooperative128, Cooperative128, GroupedGemmArgs) defines
// sm90::cooperative128_workspace_bytes and sm90::cooperative128_run(const GroupedGemmArgs&) over GemmOf bundle
// Cooperative128 (`Args`: GroupedGemmArgs for grouped_gemm's kernels, WgradGemmArgs for wgrad_gemm's).
#define MOE_EP_SM90_GEMM_ENTRY_POINTS(name, bundle, Args)                       \
  size_t moe_ep::gemm::sm90::name##_workspace_bytes(int64_t groups) {             \
    return workspace_bytes_of<bundle>(groups);                                    \
  }                                                                               \
  void moe_ep::gemm::sm90::name##_run(const Args& args) { run<bundle>(args); }
