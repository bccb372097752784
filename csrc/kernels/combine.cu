// Combine: each received row goes back to the rank it came from, which sums a token's rows in
// float32 in ascending rank order (from +0.0, one rounding to bf16), bit for bit like the reference.
// Two kernels with one protocol: combine_kernel (described here) and combine_tma_kernel (its rows go
// out as bulk copies, described above it); launch_combine picks per Context::impl.
//
// Protocol (grid = num_blocks blocks of kThreads; same stream as the dispatch that made the handle).
// epoch = epochs[kSigCombineDone] + 1 numbers this call's row flags.
//  0. Start barrier: block 0's thread r stores ready_epoch into its kSigCombineReady flag at peer r;
//     every block waits for all peers' flags (a peer raises it only after its stream finished the
//     previous call, so its data region is free: no peer is still reducing or copying from it).
//  1. Send (warps 0..kSendWarps-1 of every block). Sending warp w owns received rows w, w + W, ...:
//     a row from peer s = src_rank[j] (padding rows, src_rank -1, and this rank's own rows are
//     skipped) is stored, kSendUnroll int4 per lane in flight, into row i = src_index[j] of slot [me]
//     of s's data region (NVLink); then __syncwarp and lane 0 stores `epoch` with release semantics
//     into row flag [combine][me][i] at s.
//  2. Reduce (the other warps from the start, the sending warps once their rows are done). Warps take
//     tokens i = 0, 1, ... of this rank from a grid-wide counter. Lane r < R reads
//     is_token_in_rank[i][r]; lanes of peer sources wait for their row flag to reach `epoch`
//     (wait_flag; __syncwarp hands the order to the whole warp). Then, chunk by chunk, the warp adds
//     rank r's row for r ascending (own: x[first[me] + pos[i][me]]; peer: data slot [r] row i, read
//     through L2) into float32 accumulators with __fadd_rn (never contracted), rounds once with
//     __float2bfloat16_rn and stores out[i]. Tokens that went nowhere get +0.
//  3. arrive_last: the last block resets the work counter and advances the device epochs.
// A timeout leaves the loops early (every block still arrives, so epochs stay in step).
#include <cuda_bf16.h>

#include "kernels/intranode.h"

namespace moe_ep {
namespace intranode {

namespace {

constexpr int kSendUnroll = 4;    // int4 loads in flight per lane when sending
constexpr int kReduceUnroll = 2;  // int4 positions per lane per reduction step (8 floats each)

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    acc[2 * q] = __fadd_rn(acc[2 * q], __uint_as_float(w[q] << 16));
    acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __uint_as_float(w[q] & 0xffff0000u));
  }
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

// Row j of x back to its source rank s at index src_index[j], then its row flag.
__device__ __forceinline__ void send_row(const DeviceContext& ctx, const CombineArgs& a, int j, int s,
                                         uint64_t epoch, int lane) {
  const int me = ctx.comm.rank, row_bytes = 2 * ctx.dims.hidden, vecs = row_bytes / 16;
  const int i = reinterpret_cast<const int*>(a.src_index)[j];
  const int4* src = reinterpret_cast<const int4*>(reinterpret_cast<const char*>(a.x) + (size_t)j * row_bytes);
  int4* dst = reinterpret_cast<int4*>(ctx.region(s, ctx.ws.data) + me * ctx.ws.slot_bytes + (size_t)i * row_bytes);
  for (int first = 0; first < vecs; first += 32 * kSendUnroll) {
    int4 v[kSendUnroll];
#pragma unroll
    for (int u = 0; u < kSendUnroll; ++u) {
      const int k = first + u * 32 + lane;
      if (k < vecs) v[u] = ld_nc_int4(src + k);
    }
#pragma unroll
    for (int u = 0; u < kSendUnroll; ++u) {
      const int k = first + u * 32 + lane;
      if (k < vecs) dst[k] = v[u];
    }
  }
  __syncwarp();
  if (lane == 0) st_release_sys(ctx.row_flag(s, kCombineRows, me, i), epoch);
}

// out[i] = bf16(sum over the ranks r that received token i, ascending, of float(their row)).
// Returns false when a wait for a peer's row gave up.
__device__ __forceinline__ bool reduce_token(const DeviceContext& ctx, const CombineArgs& a, int i, uint64_t epoch,
                                             int lane) {
  const int me = ctx.comm.rank, R = ctx.comm.nranks, row_bytes = 2 * ctx.dims.hidden, vecs = row_bytes / 16;
  const bool sent = lane < R && reinterpret_cast<const bool*>(a.is_token_in_rank)[(size_t)i * R + lane];
  const unsigned sources = __ballot_sync(kFullMask, sent);
  bool ok = true;
  if (sent && lane != me) ok = wait_flag(ctx.comm, ctx.row_flag(me, kCombineRows, lane, i), epoch, kPhaseCombineRecv, lane);
  __syncwarp();
  if (!__all_sync(kFullMask, ok)) return false;

  const char* row = nullptr;  // lane r: rank r's row for token i
  if (sent) {
    if (lane == me) {
      const int first_mine = reinterpret_cast<const int*>(a.recv_info)[R + me];
      const int p = reinterpret_cast<const int*>(a.pos)[(size_t)i * R + me];
      row = reinterpret_cast<const char*>(a.x) + ((size_t)first_mine + p) * row_bytes;
    } else {
      row = ctx.region(me, ctx.ws.data) + lane * ctx.ws.slot_bytes + (size_t)i * row_bytes;
    }
  }
  int4* out = reinterpret_cast<int4*>(a.out) + (size_t)i * vecs;
  for (int first = 0; first < vecs; first += 32 * kReduceUnroll) {
    float acc[kReduceUnroll][8];
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u)
#pragma unroll
      for (int h = 0; h < 8; ++h) acc[u][h] = 0.f;
    // two sources at a time: both loads in flight, then added in rank order
    for (unsigned m = sources; m != 0;) {
      const int r0 = __ffs(m) - 1;
      m &= m - 1;
      const int r1 = __ffs(m) - 1;  // -1 when r0 was the last source
      m &= m - 1;
      const auto* src0 = reinterpret_cast<const int4*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), r0));
      const auto* src1 = reinterpret_cast<const int4*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), max(r1, 0)));
      int4 v0[kReduceUnroll], v1[kReduceUnroll];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        const int k = first + u * 32 + lane;
        if (k < vecs) {
          v0[u] = __ldcg(src0 + k);
          if (r1 >= 0) v1[u] = __ldcg(src1 + k);
        }
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        if (first + u * 32 + lane < vecs) {
          add_bf16x8(acc[u], v0[u]);
          if (r1 >= 0) add_bf16x8(acc[u], v1[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
      const int k = first + u * 32 + lane;
      if (k < vecs) out[k] = round_bf16x8(acc[u]);
    }
  }
  return true;
}

__global__ void __launch_bounds__(kThreads, 1)
combine_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ CombineArgs a) {
  const Comm& comm = ctx.comm;
  const int me = comm.rank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint64_t ready_epoch = comm.epochs[kSigCombineReady] + 1;
  const uint64_t epoch = comm.epochs[kSigCombineDone] + 1;

  // 0. start barrier
  if (blockIdx.x == 0) signal_peers(comm, kSigCombineReady, ready_epoch);
  if (wait_peers(comm, kSigCombineReady, ready_epoch, kPhaseCombineBarrier)) {
    // 1. send rows back
    if (warp < kSendWarps) {
      const auto* src_rank = reinterpret_cast<const int*>(a.src_rank);
      for (int j = blockIdx.x * kSendWarps + warp; j < a.num_rows; j += gridDim.x * kSendWarps) {
        const int s = src_rank[j];
        if (s >= 0 && s != me) send_row(ctx, a, j, s, epoch, lane);
      }
    }
    // 2. reduce this rank's tokens
    for (;;) {
      const int i = take_work_item(ctx.block_counters + 3);
      if (i >= a.num_tokens || !reduce_token(ctx, a, i, epoch, lane)) break;
    }
  }

  // 3. bookkeeping for the next call
  if (arrive_last(ctx.block_counters + 1)) {
    ctx.block_counters[3] = 0;
    comm.epochs[kSigCombineReady] = ready_epoch;
    comm.epochs[kSigCombineDone] = epoch;
  }
}

// ---- TMA variant ----
// combine_tma_kernel: same start barrier, row flags, epochs and regions as combine_kernel. Warp 0
// sends with tma_send (kernels/intranode.h): waves of B consecutive received rows j, each row with
// a peer source s = src_rank[j] bulk-loaded once and bulk-stored to row src_index[j] of slot [me]
// of s's data region, its flag published one wave later. Warps 1..31 reduce from the start (as in
// combine_kernel, reduce_token), warp 0 joins them once its rows are out.
struct CombineSendPlan {
  const DeviceContext* ctx;
  const CombineArgs* a;
  int items, width, row_bytes;  // received rows, 2 (source rank, source index), bytes per row

  __device__ __forceinline__ int entry(int j, int e) const {
    return __ldg(reinterpret_cast<const int*>(e == 0 ? a->src_rank : a->src_index) + j);
  }
  __device__ __forceinline__ bool wanted(const int* e) const { return e[0] >= 0 && e[0] != ctx->comm.rank; }
  __device__ __forceinline__ const char* source(int j) const {
    return reinterpret_cast<const char*>(a->x) + (size_t)j * row_bytes;
  }
  template <class F>
  __device__ __forceinline__ void for_each_dest(const int* e, F&& f) const {
    if (!wanted(e)) return;
    const int s = e[0], i = e[1], me = ctx->comm.rank;
    f(ctx->region(s, ctx->ws.data) + me * ctx->ws.slot_bytes + (size_t)i * row_bytes,
      ctx->row_flag(s, kCombineRows, me, i));
  }
  __device__ __forceinline__ void metadata(int, int, const int (*)[kMaxRanks], int) const {}
};

__global__ void __launch_bounds__(kThreads, 1)
combine_tma_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ CombineArgs a, int send_rows) {
  extern __shared__ __align__(128) char stages[];
  __shared__ __align__(8) uint64_t bars[2];
  __shared__ int table[4][tma::kMaxRows][kMaxRanks];
  const Comm& comm = ctx.comm;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint64_t ready_epoch = comm.epochs[kSigCombineReady] + 1;
  const uint64_t epoch = comm.epochs[kSigCombineDone] + 1;

  if (threadIdx.x < 2) tma::init_barrier(&bars[threadIdx.x]);
  tma::fence_barrier_init();
  __syncthreads();

  if (blockIdx.x == 0) signal_peers(comm, kSigCombineReady, ready_epoch);
  if (wait_peers(comm, kSigCombineReady, ready_epoch, kPhaseCombineBarrier)) {
    if (warp == 0) {
      const CombineSendPlan plan{&ctx, &a, a.num_rows, 2, 2 * ctx.dims.hidden};
      tma_send(plan, stages, bars, table, send_rows, epoch);
    }
    for (;;) {
      const int i = take_work_item(ctx.block_counters + 3);
      if (i >= a.num_tokens || !reduce_token(ctx, a, i, epoch, lane)) break;
    }
  }

  if (arrive_last(ctx.block_counters + 1)) {
    ctx.block_counters[3] = 0;
    comm.epochs[kSigCombineReady] = ready_epoch;
    comm.epochs[kSigCombineDone] = epoch;
  }
}

}  // namespace

void launch_combine(const Context& c, const CombineArgs& a, uintptr_t stream) {
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  const TmaShape shape = c.impl == Impl::kTma ? tma_shape(c, 2 * c.dims.hidden, false) : TmaShape{};
  if (shape.send_rows > 0) {
    ensure_dynamic_smem(combine_tma_kernel, kTmaSmemBytes, "cudaFuncSetAttribute(moe_ep intranode combine TMA kernel)");
    combine_tma_kernel<<<a.num_blocks, kThreads, shape.smem_bytes, st>>>(make_device_context(c), a, shape.send_rows);
    check_launch("moe_ep intranode combine TMA kernel");
    return;
  }
  combine_kernel<<<a.num_blocks, kThreads, 0, st>>>(make_device_context(c), a);
  check_launch("moe_ep intranode combine kernel");
}

}  // namespace intranode
}  // namespace moe_ep
