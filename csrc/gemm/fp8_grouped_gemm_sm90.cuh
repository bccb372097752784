// FP8 grouped GEMM with DeepSeek-V3 block scales on Hopper (sm_90a), built from CUTLASS's pointer-array
// grouped GEMM with software block scaling (KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise).
//
// What runs where, per call (fp8_grouped_gemm.h states the arithmetic):
//   host    picks the compiled kernel (TileConfig), fills CUTLASS's Arguments with the device addresses of the
//           per-group tables (no group sizes: the host problem shapes are null) and encodes the TMA
//           descriptor templates (driver calls, no synchronisation);
//   device  1. write_group_tables (group_tables.cuh): one block turns counts into each group's shape,
//              addresses, strides and scale layouts;
//           2. the persistent grouped GEMM, one CTA (or cluster of two) per SM: a producer warp loads A and B
//              tiles by TMA (descriptors patched in shared memory whenever the group changes) and the scales
//              by cp.async; the consumer warpgroups run WGMMA over each 128-deep K block, multiply that
//              block's float32 partial sums by a_scale[row] * b_scale[column block] and add them to the
//              float32 accumulators; the epilogue rounds to bf16 (round to nearest even) and stores by TMA,
//              clipped to the group's rows.
// This header holds the kernel templates; each TileConfig is compiled in a translation unit of its own
// (fp8_grouped_gemm_sm90_<config>.cu, so nvcc builds them in parallel) and fp8_grouped_gemm_sm90.cu picks one.
// Relies on: K and N multiples of 128 (one scale per K block, one b scale per 128-column tile), a, b and out
// 16-byte aligned (TMA), rows < 2^31 and n, k < 2^31 (CUTLASS's int problem shape), the workspace from
// workspace_bytes on the same device. Scales are K-major (a_scale [rows, k / 128] row-major is that layout
// as is, each group's slice starting at its first row), so no transpose runs. C is not read (ElementC void).
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

// One compiled grouped GEMM: CTA tile, cluster and the mainloop / epilogue schedules.
template <class Tile, class Cluster, class MainloopSchedule, class EpilogueSchedule>
struct GemmOf {
  using ElementAB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group

  // a_scale: one scale per row per 128 K (granularity 1 x 128), b_scale one per 128 x 128; both K-major.
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock, GMMA::Major::K,
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
  static_assert(std::is_same_v<StrideA, Stride<int64_t, _1, _0>>, "A: rows k elements apart, K contiguous");
  static_assert(std::is_same_v<StrideB, Stride<int64_t, _1, _0>>, "B: columns (N) k elements apart, K contiguous");
  static_assert(std::is_same_v<StrideD, Stride<int64_t, _1, _0>>, "D: rows n elements apart, N contiguous");
  static_assert(std::is_same_v<typename Kernel::InternalStrideC, StrideD>, "C shares D's stride table");
  static_assert(std::is_same_v<typename Mainloop::InternalLayoutSFA, LayoutSFA> &&
                    std::is_same_v<typename Mainloop::InternalLayoutSFB, LayoutSFB>,
                "the mainloop reads the scale layouts the tables hold");

  __device__ static StrideA row_stride_a(int64_t k) { return make_stride(k, _1{}, _0{}); }
  __device__ static StrideB row_stride_b(int64_t k) { return make_stride(k, _1{}, _0{}); }
  __device__ static StrideD row_stride_d(int64_t n) { return make_stride(n, _1{}, _0{}); }
};

using Cooperative128 =
    GemmOf<Shape<_128, _128, _128>, Shape<_1, _2, _1>,
           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
           cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
using Pingpong64 = GemmOf<Shape<_64, _128, _128>, Shape<_1, _2, _1>,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

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

template <class G>
void run(const GroupedGemmArgs& args) {
  const size_t need = workspace_bytes_of<G>(args.groups);
  if (static_cast<size_t>(args.workspace_bytes) < need)
    throw std::invalid_argument("fp8_grouped_gemm: workspace_bytes = " + std::to_string(args.workspace_bytes) +
                                ", this device and config need " + std::to_string(need));
  const auto stream = reinterpret_cast<cudaStream_t>(args.stream);
  const GroupTables<G> tables = GroupTables<G>::carve(args.workspace, args.groups);
  const TableInputs inputs{reinterpret_cast<const int32_t*>(args.counts), args.a, args.a_scale, args.b,
                           args.b_scale, args.out, args.rows, args.n, args.k, args.groups};
  write_group_tables<G><<<1, kTableThreads, 0, stream>>>(tables, inputs);
  MOE_EP_CUDA_CHECK(cudaGetLastError());

  void* cutlass_workspace = reinterpret_cast<void*>(args.workspace + align_up(GroupTables<G>::bytes(args.groups)));
  const auto arguments = gemm_arguments<G>(tables, args.groups, static_cast<Raster>(args.raster));
  typename G::Gemm gemm;
  check_status(gemm.can_implement(arguments), "can_implement");
  check_status(gemm.initialize(arguments, cutlass_workspace, stream), "initialize");
  check_status(gemm.run(stream), "launch");
  MOE_EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace sm90
}  // namespace gemm
}  // namespace moe_ep

// The two entry points of one TileConfig (fp8_grouped_gemm.h), for its translation unit to define at global scope:
// MOE_EP_SM90_GEMM_ENTRY_POINTS(cooperative128, Cooperative128) defines sm90::cooperative128_workspace_bytes and
// sm90::cooperative128_run over GemmOf bundle Cooperative128.
#define MOE_EP_SM90_GEMM_ENTRY_POINTS(name, bundle)                             \
  size_t moe_ep::gemm::sm90::name##_workspace_bytes(int64_t groups) {             \
    return workspace_bytes_of<bundle>(groups);                                    \
  }                                                                               \
  void moe_ep::gemm::sm90::name##_run(const GroupedGemmArgs& args) { run<bundle>(args); }
