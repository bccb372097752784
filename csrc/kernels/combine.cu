// Combine: each received row goes back to the rank it came from, which sums a token's rows in
// float32 in ascending rank order (from +0.0, one rounding to bf16), bit for bit like the reference.
//
// Protocol (grid = num_blocks blocks of kThreads; same stream as the dispatch that made the handle):
//  0. Start barrier: block 0's thread r stores ready_epoch into its kSigCombineReady flag at peer r;
//     every block waits for all peers' flags (a peer raises it only after its stream finished the
//     previous call, so its data region is free: no peer is still reducing or copying from it).
//  1. Send. Warp w of the grid owns received rows w, w + W, ...: a row from peer s = src_rank[j]
//     (padding rows, src_rank -1, and this rank's own rows are skipped) is stored, kUnroll int4 per
//     lane in flight, into row src_index[j] of slot [me] of s's data region (NVLink).
//  2. arrive_last: system-scope fences, the last block stores done_epoch (release) into its
//     kSigCombineDone flag at every peer and advances the device epochs.
//  3. Reduce. Every block waits for all peers' kSigCombineDone >= done_epoch (acquire). Warp w owns
//     tokens w, w + W, ...: lane r < R reads is_token_in_rank[i][r]; for each chunk of the row the
//     warp adds, for r ascending, rank r's row (own: x[first[me] + pos[i][me]]; peer: data slot [r]
//     row i, read with ld.cg) into float32 accumulators with __fadd_rn (never contracted), rounds
//     once with __float2bfloat16_rn and stores out[i]. Tokens that went nowhere get +0.
// A timeout leaves the kernel early (after counting the block in) and suppresses the done flags.
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

__global__ void __launch_bounds__(kThreads, 1)
combine_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ CombineArgs a) {
  const Comm& comm = ctx.comm;
  const int me = comm.rank, R = comm.nranks;
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32, num_warps = gridDim.x * kWarps;
  const int row_bytes = 2 * ctx.dims.hidden, vecs = row_bytes / 16;
  const char* x = reinterpret_cast<const char*>(a.x);
  const uint64_t ready_epoch = comm.epochs[kSigCombineReady] + 1;
  const uint64_t done_epoch = comm.epochs[kSigCombineDone] + 1;

  // 0. start barrier
  if (blockIdx.x == 0) signal_peers(comm, kSigCombineReady, ready_epoch);
  const bool ok = wait_peers(comm, kSigCombineReady, ready_epoch, kPhaseCombineBarrier);

  // 1. send rows back
  if (ok) {
    const auto* src_rank = reinterpret_cast<const int*>(a.src_rank);
    const auto* src_index = reinterpret_cast<const int*>(a.src_index);
    for (int j = warp; j < a.num_rows; j += num_warps) {
      const int s = src_rank[j];
      if (s < 0 || s == me) continue;
      const int4* src = reinterpret_cast<const int4*>(x + (size_t)j * row_bytes);
      int4* dst = reinterpret_cast<int4*>(ctx.region(s, ctx.ws.data) + me * ctx.ws.slot_bytes +
                                          (size_t)src_index[j] * row_bytes);
      for (int first = 0; first < vecs; first += 32 * kSendUnroll) {
        int4 v[kSendUnroll];
#pragma unroll
        for (int u = 0; u < kSendUnroll; ++u) {
          const int i = first + u * 32 + lane;
          if (i < vecs) v[u] = ld_nc_int4(src + i);
        }
#pragma unroll
        for (int u = 0; u < kSendUnroll; ++u) {
          const int i = first + u * 32 + lane;
          if (i < vecs) dst[i] = v[u];
        }
      }
    }
  }

  // 2. publish
  if (arrive_last(ctx.block_counters + 1)) {
    if (!comm_aborted(comm)) signal_peers_from_one_thread(comm, kSigCombineDone, done_epoch);
    comm.epochs[kSigCombineReady] = ready_epoch;
    comm.epochs[kSigCombineDone] = done_epoch;
  }
  if (!ok) return;

  // 3. reduce
  if (!wait_peers(comm, kSigCombineDone, done_epoch, kPhaseCombineRecv)) return;
  const auto* in_rank = reinterpret_cast<const bool*>(a.is_token_in_rank);
  const auto* pos = reinterpret_cast<const int*>(a.pos);
  const int first_mine = reinterpret_cast<const int*>(a.recv_info)[R + me];
  const char* data = ctx.region(me, ctx.ws.data);
  int4* out = reinterpret_cast<int4*>(a.out);
  for (int i = warp; i < a.num_tokens; i += num_warps) {
    const bool sent = lane < R && in_rank[(size_t)i * R + lane];
    const unsigned sources = __ballot_sync(kFullMask, sent);
    const char* row = nullptr;  // lane r: rank r's row for token i
    if (sent) {
      row = lane == me ? x + ((size_t)first_mine + pos[(size_t)i * R + me]) * row_bytes
                       : data + lane * ctx.ws.slot_bytes + (size_t)i * row_bytes;
    }
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
        const int4* src0 = reinterpret_cast<const int4*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), r0));
        const int4* src1 = reinterpret_cast<const int4*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), max(r1, 0)));
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
        if (k < vecs) out[(size_t)i * vecs + k] = round_bf16x8(acc[u]);
      }
    }
  }
}

}  // namespace

void launch_combine(const Context& c, const CombineArgs& a, uintptr_t stream) {
  combine_kernel<<<a.num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(make_device_context(c), a);
  check_launch("moe_ep intranode combine kernel");
}

}  // namespace intranode
}  // namespace moe_ep
