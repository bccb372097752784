// Combine: each received row goes back to the rank it came from, which sums a token's rows in
// float32 in ascending rank order (from +0.0, one rounding to bf16), bit for bit like the reference.
// With topk_weights, each row's K float32 weights travel with it and are summed in the same order,
// in float32 from +0.0, never rounded.
//
// Protocol (grid = num_blocks blocks of kThreads; same stream as the dispatch that made the handle).
// epoch = epochs[kSigCombineDone] + 1 numbers this call's row flags. W = Tuning::combine_send_warps,
// U = Tuning::unroll (template parameter), G = Tuning::flag_batch, B = Tuning::recv_run.
//  0. Start barrier: block 0's thread r stores ready_epoch into its kSigCombineReady flag at peer r;
//     every block waits for all peers' flags (a peer raises it only after its stream finished the
//     previous call, so its data region is free: no peer is still reducing or copying from it).
//  1. Send (warps 0..W-1 of every block). Sending warp w owns received rows w, w + W', ...
//     (W' = W * grid), reading src_rank / src_index of its next row one row ahead: a row from peer
//     s = src_rank[j] (padding rows, src_rank -1, and this rank's own rows are skipped) is stored, U
//     int4 per lane in flight, into row i = src_index[j] of slot [me] of s's data region (NVLink);
//     with weights, lanes k < K (having loaded topk_weights[j][k] before the row) store them into
//     row i of slot [me] of s's weights region. The row's flag, [combine][me][i] at s, joins the
//     warp's pending flags (shared memory); once G are pending (and at the end) the warp publishes
//     them: __syncwarp, one fence.acq_rel.sys, then relaxed stores of `epoch` (intranode.h "Row
//     flags", in this folder), so a flag is raised only after its row and its weights.
//  2. Reduce (the other warps from the start, the sending warps once their rows are done). Warps take
//     runs of B tokens [kB, kB + B) of this rank from a grid-wide counter (one ahead: intranode.h
//     WorkItems). Per token i: lane r < R reads is_token_in_rank[i][r], and lane me (in the same round
//     trip) pos[i][me] and first[me]; lanes of peer sources wait for their row flag to reach `epoch`
//     (wait_geq; __syncwarp hands the order to the whole warp). With weights, lane k < K first sums
//     rank r's weight k for r ascending (own: topk_weights[first[me] + pos[i][me]]; peer: weights
//     slot [r] row i, read through L2) in float32 from +0.0 with __fadd_rn and stores
//     out_topk_weights[i][k], unrounded. Then, chunk by chunk, the warp adds rank r's row for r
//     ascending (own: x[first[me] + pos[i][me]]; peer: data slot [r] row i, read through L2) into
//     float32 accumulators with __fadd_rn (never contracted), rounds once with __float2bfloat16_rn
//     and stores out[i]: two sources at a time, kReduceUnroll int4 of each per lane in flight. A token
//     with one source (every token at EP1) goes through the same arithmetic per int4 (+0.0 plus it,
//     one rounding: the same bits) with kOneSourceUnroll int4 per lane in flight and no accumulators
//     held across loads. Tokens that went nowhere get +0 (rows and weights).
//  3. arrive_last: the last block resets the work counter and advances the device epochs.
// A timeout ends the waiting: the warp that gave up (and every warp of a block whose start barrier
// gave up) writes NaN over the rest of its tokens (rows and weights) and keeps taking work items only
// to write NaN, so the failed call's output holds no row that looks valid; every block still
// arrives, so epochs stay in step.
#include <cuda_bf16.h>

#include "kernels/common/bf16_math.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/warp.cuh"
#include "kernels/common/warp_copy.cuh"
#include "kernels/intranode/intranode.h"

namespace moe_ep {
namespace intranode {

namespace {

constexpr int kReduceUnroll = 2;  // int4 positions per lane per reduction step (8 floats each), per source
constexpr int kOneSourceUnroll = 4;  // int4 loads per lane in flight for a token with one source

// Row j of x back to its source rank s, at row i of slot [me] of s's data region, and with weights
// (lanes k < K) its weights at row i of slot [me] of s's weights region.
template <int kU>
__device__ __forceinline__ void send_row(const DeviceContext& ctx, const CombineArgs& a, int j, int s, int i,
                                         int lane) {
  const int me = ctx.comm.rank, row_bytes = 2 * ctx.dims.hidden, K = ctx.dims.num_topk;
  const bool weighs = a.with_weights && lane < K;
  const float weight = weighs ? __ldg(reinterpret_cast<const float*>(a.topk_weights) + (size_t)j * K + lane) : 0.f;
  const int4* src = reinterpret_cast<const int4*>(reinterpret_cast<const char*>(a.x) + (size_t)j * row_bytes);
  int4* dst = reinterpret_cast<int4*>(ctx.region(s, ctx.ws.data) + me * ctx.ws.slot_bytes + (size_t)i * row_bytes);
  warp_copy<kU>(src, row_bytes / 16, lane, LoadNc{}, 1u, [dst](int) { return dst; });
  if (weighs)
    reinterpret_cast<float*>(ctx.region(s, ctx.ws.weights))[((size_t)me * ctx.dims.max_tokens + i) * K + lane] = weight;
}

// out[i] = bf16(sum over the ranks r that received token i, ascending, of float(their row)), and with
// weights out_topk_weights[i] = the float32 sum of their weight rows in the same order.
// Returns false when a wait for a peer's row gave up.
__device__ __forceinline__ bool reduce_token(const DeviceContext& ctx, const CombineArgs& a, int i, uint64_t epoch,
                                             int lane) {
  const int me = ctx.comm.rank, R = ctx.comm.nranks, row_bytes = 2 * ctx.dims.hidden, vecs = row_bytes / 16;
  const int K = ctx.dims.num_topk;
  const bool sent = lane < R && reinterpret_cast<const bool*>(a.is_token_in_rank)[(size_t)i * R + lane];
  // this rank's own row of token i, first[me] + pos[i][me] (pos is -1 where i stayed away), loaded
  // beside is_token_in_rank rather than after it
  const size_t own_at = lane == me ? reinterpret_cast<const int*>(a.recv_info)[R + me] +
                                         (size_t)reinterpret_cast<const int*>(a.pos)[(size_t)i * R + me]
                                   : 0;
  const unsigned sources = __ballot_sync(kFullMask, sent);
  bool ok = true;
  if (sent && lane != me) ok = wait_geq(ctx.comm, ctx.row_flag(me, kCombineRows, lane, i), epoch, kPhaseCombineRecv, lane);
  __syncwarp();
  if (!__all_sync(kFullMask, ok)) return false;

  // lane r: rank r's row for token i and, with weights, its weight row; nullptr where r did not receive i
  const char* row = nullptr;
  const float* weights = nullptr;
  if (sent) {
    const bool own = lane == me;
    // own: row first[me] + pos[i][me] of x (and topk_weights); peer: row i of slot r ([R][T] regions)
    const size_t at = own ? own_at : (size_t)lane * ctx.dims.max_tokens + i;
    row = (own ? reinterpret_cast<const char*>(a.x) : ctx.region(me, ctx.ws.data)) + at * row_bytes;
    if (a.with_weights)
      weights = (own ? reinterpret_cast<const float*>(a.topk_weights)
                     : reinterpret_cast<const float*>(ctx.region(me, ctx.ws.weights))) + at * K;
  }
  if (a.with_weights)
    warp_sum_weights(reinterpret_cast<float*>(a.out_topk_weights) + (size_t)i * K, R,
                     [&](int r) {
                       return reinterpret_cast<const float*>(
                           __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(weights), r));
                     },
                     K, lane);
  int4* out = reinterpret_cast<int4*>(a.out) + (size_t)i * vecs;
  if (__popc(sources) == 1) {  // one source: per int4 the same arithmetic (+0.0 plus it, one rounding)
    const auto* src = reinterpret_cast<const int4*>(
        __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), __ffs(sources) - 1));
    warp_copy<kOneSourceUnroll>(src, vecs, lane, LoadCg{}, 1u, [out](int) { return out; }, [](const int4& v) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      add_bf16x8(acc, v);
      return round_bf16x8(acc);
    });
    return true;
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

template <int kU>
__global__ void __launch_bounds__(kThreads, 1)
combine_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ CombineArgs a) {
  const Comm& comm = ctx.comm;
  if (block_stamps_disagreed(comm)) return;  // the call's stamp exchange found the ranks' calls differ (comm.h)
  const int me = comm.rank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int send_warps = ctx.tuning.combine_send_warps, batch = ctx.tuning.flag_batch, B = ctx.tuning.recv_run;
  const uint64_t ready_epoch = comm.epochs[kSigCombineReady] + 1;
  const uint64_t epoch = comm.epochs[kSigCombineDone] + 1;

  // 0. start barrier
  if (blockIdx.x == 0) signal_peers(comm, kSigCombineReady, ready_epoch);
  bool ok = wait_peers(comm, kSigCombineReady, ready_epoch, kPhaseCombineBarrier);
  if (ok) {
    // 1. send rows back
    if (warp < send_warps) {
      const auto* src_rank = reinterpret_cast<const int*>(a.src_rank);
      const auto* src_index = reinterpret_cast<const int*>(a.src_index);
      const int stride = gridDim.x * send_warps;
      __shared__ uint64_t* flag_slots[kWarps][32];
      PendingFlags pending{flag_slots[warp]};
      int j = blockIdx.x * send_warps + warp;
      int s_next = j < a.num_rows ? __ldg(src_rank + j) : -1;
      int i_next = j < a.num_rows ? __ldg(src_index + j) : 0;
      for (; j < a.num_rows; j += stride) {
        const int s = s_next, i = i_next;
        s_next = j + stride < a.num_rows ? __ldg(src_rank + j + stride) : -1;
        i_next = j + stride < a.num_rows ? __ldg(src_index + j + stride) : 0;
        if (s < 0 || s == me) continue;
        send_row<kU>(ctx, a, j, s, i, lane);
        pending.add(ctx.row_flag(s, kCombineRows, me, i), 0, lane);
        if (pending.count >= batch) pending.publish(epoch, lane);
      }
      pending.publish(epoch, lane);
    }
  }
  // 2. reduce this rank's tokens, B at a time; after a wait gave up, the warp writes NaN rows for the
  //    rest (every token is still taken by some warp, so a failed call returns no row that looks valid)
  const int vecs = 2 * ctx.dims.hidden / 16, items = (a.num_tokens + B - 1) / B;
  for (WorkItems work(ctx.block_counters + kCombineWork);;) {
    const int item = work.next(items);
    if (item >= items) break;
    const int first = item * B;
    const int last = min(first + B, a.num_tokens);
    int i = first;
    for (; ok && i < last; ++i) ok = reduce_token(ctx, a, i, epoch, lane);
    if (ok) continue;
    for (i = max(i - 1, first); i < last; ++i) {  // from the token whose wait gave up
      for (int k = lane; k < vecs; k += 32) reinterpret_cast<int4*>(a.out)[(size_t)i * vecs + k] = bf16_nan_x8();
      if (a.with_weights && lane < ctx.dims.num_topk)
        reinterpret_cast<float*>(a.out_topk_weights)[(size_t)i * ctx.dims.num_topk + lane] = f32_nan();
    }
  }

  // 3. bookkeeping for the next call
  if (arrive_last(ctx.block_counters + kCombineDone)) {
    ctx.block_counters[kCombineWork] = 0;
    comm.epochs[kSigCombineReady] = ready_epoch;
    comm.epochs[kSigCombineDone] = epoch;
  }
}

}  // namespace

void launch_combine(const Context& c, const CombineArgs& a, uintptr_t stream) {
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  const DeviceContext d = make_device_context(c);
  switch (c.tuning.unroll) {
    case 6: combine_kernel<6><<<a.num_blocks, kThreads, 0, st>>>(d, a); break;
    default: combine_kernel<4><<<a.num_blocks, kThreads, 0, st>>>(d, a); break;
  }
  check_launch("moe_ep intranode combine kernel");
}

}  // namespace intranode
}  // namespace moe_ep
