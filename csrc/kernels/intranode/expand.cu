// Expand: the (row, local expert) pairs of an expert-major dispatch whose rows stayed in this rank's
// workspace (DispatchArgs::expert_major), copied out in one pass: a token that goes to two local
// experts crossed the link once and becomes its two pairs here, where it is copied into the output.
//
// Protocol (grid = num_blocks blocks of kThreads, launched on the dispatch's stream right after the
// dispatch kernel, ExpandArgs in intranode.h):
//  - Ordering: every row read here landed before this kernel starts: a peer's row was acquired by a
//    receiving warp of the dispatch kernel (its row flag, intranode.h "Row flags"), this rank's own
//    rows were stored by its own sending warps, and the end of that kernel orders both before this one
//    (same stream). No peer writes this workspace again before this rank's next call raises its start
//    barrier (intranode.h: dispatch and combine share `data` behind a barrier), and that call comes
//    later on the same stream.
//  - Thread 0 of each block reads the error word once (comm.h ErrorState): set, the dispatch (or an
//    earlier kernel) gave up, and every pair the block visits gets poison (bf16 NaN or e4m3 0x7f bytes,
//    NaN scales) instead of workspace bytes, as the dispatch's own outputs do after a give-up.
//  - Warp w of block b copies pairs q = b * kWarps + w, q + kWarps * grid, ...: received row
//    r = rows[q], its source s = src_rank[r] and position p = r - recv_info[R + s] in slot s of the
//    data region; the row's int4s go to out_x row q through L2 (ld.cg), four loads per lane in flight,
//    then its scales from `scales` row r. rows[q] = -1 (alignment padding) gets zero x and scales.
#include "kernels/common/launch.cuh"
#include "kernels/common/warp.cuh"
#include "kernels/common/warp_copy.cuh"
#include "kernels/intranode/intranode.h"

namespace moe_ep {
namespace intranode {

namespace {

constexpr int kExpandUnroll = 4;

// Pair q's x (row_bytes / 16 int4) and scales set to `bits` / `scale` by one warp.
__device__ __forceinline__ void fill_pair(const ExpandArgs& a, size_t q, int4 bits, float scale, int lane) {
  int4* x = reinterpret_cast<int4*>(reinterpret_cast<char*>(a.out_x) + q * a.row_bytes);
  for (int i = lane; i < a.row_bytes / 16; i += 32) x[i] = bits;
  for (int j = lane; j < a.num_scales; j += 32) reinterpret_cast<float*>(a.out_scales)[q * a.num_scales + j] = scale;
}

__global__ void __launch_bounds__(kThreads, 1)
expand_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ ExpandArgs a) {
  const int me = ctx.comm.rank, R = ctx.comm.nranks, S = a.num_scales;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool failed = __syncthreads_or(threadIdx.x == 0 && comm_aborted(ctx.comm)) != 0;
  const int4 poison = S > 0 ? e4m3_nan_x16() : bf16_nan_x8();
  const auto* rows = reinterpret_cast<const long long*>(a.rows);
  const auto* src_rank = reinterpret_cast<const int*>(a.src_rank);
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
  const char* data = ctx.region(me, ctx.ws.data);

  for (size_t q = (size_t)blockIdx.x * kWarps + warp; q < (size_t)a.num_pairs; q += (size_t)gridDim.x * kWarps) {
    const long long row = __ldg(rows + q);
    const int s = row >= 0 ? __ldg(src_rank + row) : -1;
    if (failed || (row >= 0 && (s < 0 || s >= R))) {  // a give-up poisoned src_rank too
      fill_pair(a, q, poison, f32_nan(), lane);
      continue;
    }
    if (row < 0) {
      fill_pair(a, q, make_int4(0, 0, 0, 0), 0.f, lane);
      continue;
    }
    const size_t p = row - __ldg(recv_info + R + s);
    const char* src = data + s * ctx.ws.slot_bytes + p * a.row_bytes;
    warp_copy_cg<kExpandUnroll>(reinterpret_cast<int4*>(reinterpret_cast<char*>(a.out_x) + q * a.row_bytes),
                                reinterpret_cast<const int4*>(src), a.row_bytes / 16, lane);
    for (int j = lane; j < S; j += 32)
      reinterpret_cast<float*>(a.out_scales)[q * S + j] = __ldg(reinterpret_cast<const float*>(a.scales) + row * S + j);
  }
}

}  // namespace

void launch_expand(const Context& c, const ExpandArgs& a, uintptr_t stream) {
  if (a.num_pairs == 0) return;
  const DeviceContext d = make_device_context(c);
  expand_kernel<<<a.num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(d, a);
  check_launch("moe_ep intranode expand kernel");
}

}  // namespace intranode
}  // namespace moe_ep
