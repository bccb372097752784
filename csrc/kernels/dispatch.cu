// Dispatch: every token row goes once to each rank that holds one of its experts.
//
// Protocol (grid = num_blocks blocks of kThreads; runs after notify on the same stream, which gave
// pos [N, R] and recv_info). epoch = epochs[kSigDispatchDone] + 1 numbers this call's row flags.
//  0. Cached dispatch only (no notify ran): block 0's thread r stores ready_epoch into its
//     kSigDispatchReady flag at peer r; every block waits for all peers' ready flags (start barrier:
//     a peer raises it only after its stream finished the previous call).
//  1. Send (warps 0..kSendWarps-1 of every block). Sending warp w owns tokens w, w + W, ... For
//     token n, lane r < R reads pos[n][r]; a ballot gives the destination set. The warp loads the row
//     in chunks of kUnroll int4 per lane (all loads of a chunk in flight) and stores each chunk to
//     every destination: this rank's output row first[me] + pos (local), or row pos of slot [me] in
//     peer r's data region (NVLink stores through the peer address). Lanes then write the metadata
//     to the same places: topk_idx rewritten to the destination's local expert ids (-1 elsewhere),
//     weights (0 where -1), src_index = n, FP8 scales (own rows also get src_rank). Then __syncwarp
//     and lane r stores `epoch` with release semantics into row flag [dispatch][me][pos] at peer r:
//     the barrier orders every lane's stores before that release, which publishes the row.
//  2. Receive (the other warps from the start, the sending warps once their tokens are done). Warps
//     take output positions p = 0, 1, ... from a grid-wide counter; for p and each source s: a
//     peer's row p (p < count_s) is copied, once lane 0 saw its row flag reach `epoch` (acquire;
//     __syncwarp hands the order to the other lanes), from slot s of the data region to output row
//     first[s] + p, with its metadata (reads through L2: ld.cg) and src_rank = s. Padding rows of
//     worst-case mode get src = -1, topk_idx = -1, weights = 0, scales = 0. This rank's own rows were
//     written by its senders. Receiving overlaps sending, so peers' rows reach the output while the
//     link is still busy.
//  3. arrive_last: the last block resets the work counter and advances the device epochs.
// A timeout in a wait leaves the loops early (every block still arrives, so epochs stay in step);
// the host raises CommTimeoutError.
#include "kernels/intranode.h"

namespace moe_ep {
namespace intranode {

namespace {

constexpr int kUnroll = 4;  // int4 loads in flight per lane

// Rows, then metadata, then the row flags of token n to every destination in `dests`. Lane r holds
// destination r's position `p`, its row address `row` and its metadata row index `meta_row`.
__device__ __forceinline__ void send_token(const DeviceContext& ctx, const DispatchArgs& a, int n, unsigned dests,
                                           int p, char* row, size_t meta_row, uint64_t epoch, int lane) {
  const int me = ctx.comm.rank, K = ctx.dims.num_topk, num_local = ctx.dims.num_experts / ctx.comm.nranks;
  const int vecs = a.row_bytes / 16;
  const int4* src = reinterpret_cast<const int4*>(reinterpret_cast<const char*>(a.x) + (size_t)n * a.row_bytes);
  for (int first = 0; first < vecs; first += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = first + u * 32 + lane;
      if (i < vecs) v[u] = ld_nc_int4(src + i);
    }
    for (unsigned m = dests; m != 0; m &= m - 1) {
      const int r = __ffs(m) - 1;
      int4* dst = reinterpret_cast<int4*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), r));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = first + u * 32 + lane;
        if (i < vecs) dst[i] = v[u];
      }
    }
  }

  int64_t expert = -1;
  float weight = 0.f;
  if (!a.cached && lane < K) {
    expert = reinterpret_cast<const int64_t*>(a.topk_idx)[(size_t)n * K + lane];
    weight = reinterpret_cast<const float*>(a.topk_weights)[(size_t)n * K + lane];
  }
  for (unsigned m = dests; m != 0; m &= m - 1) {
    const int r = __ffs(m) - 1;
    const bool local = r == me;
    const size_t at = __shfl_sync(kFullMask, static_cast<unsigned long long>(meta_row), r);
    if (!a.cached) {
      if (lane < K) {
        const int64_t id = expert >= 0 && expert / num_local == r ? expert - static_cast<int64_t>(r) * num_local : -1;
        auto* topk = local ? reinterpret_cast<int64_t*>(a.out_topk_idx)
                           : reinterpret_cast<int64_t*>(ctx.region(r, ctx.ws.topk));
        auto* weights = local ? reinterpret_cast<float*>(a.out_topk_weights)
                              : reinterpret_cast<float*>(ctx.region(r, ctx.ws.weights));
        topk[at * K + lane] = id;
        weights[at * K + lane] = id >= 0 ? weight : 0.f;
      }
      if (lane == 0) {
        auto* src_index = local ? reinterpret_cast<int*>(a.out_src_index)
                                : reinterpret_cast<int*>(ctx.region(r, ctx.ws.src_index));
        src_index[at] = n;
        if (local) reinterpret_cast<int*>(a.out_src_rank)[at] = me;
      }
    }
    if (a.num_scales > 0) {
      const float* in = reinterpret_cast<const float*>(a.x_scales) + (size_t)n * a.num_scales;
      float* out = local ? reinterpret_cast<float*>(a.out_scales) : reinterpret_cast<float*>(ctx.region(r, ctx.ws.scales));
      for (int j = lane; j < a.num_scales; j += 32) out[at * a.num_scales + j] = in[j];
    }
  }

  __syncwarp();
  if (lane != me && ((dests >> lane) & 1u)) st_release_sys(ctx.row_flag(lane, kDispatchRows, me, p), epoch);
}

// Output row first[s] + p: row p of source s, or padding (worst case, p >= count_s). Returns false
// when the wait for the row gave up.
__device__ __forceinline__ bool receive_row(const DeviceContext& ctx, const DispatchArgs& a, int s, int p,
                                            uint64_t epoch, int lane) {
  const int me = ctx.comm.rank, R = ctx.comm.nranks, K = ctx.dims.num_topk, S = a.num_scales;
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
  const int count = recv_info[s];
  const size_t row = (size_t)recv_info[R + s] + p;
  auto* out_scales = reinterpret_cast<float*>(a.out_scales);
  if (p >= count) {
    if (!a.worst_case) return true;
    if (!a.cached) {
      if (lane < K) {
        reinterpret_cast<int64_t*>(a.out_topk_idx)[row * K + lane] = -1;
        reinterpret_cast<float*>(a.out_topk_weights)[row * K + lane] = 0.f;
      }
      if (lane == 0) {
        reinterpret_cast<int*>(a.out_src_rank)[row] = -1;
        reinterpret_cast<int*>(a.out_src_index)[row] = -1;
      }
    }
    for (int j = lane; j < S; j += 32) out_scales[row * S + j] = 0.f;
    return true;
  }
  if (s == me) return true;  // written by this rank's senders

  bool ok = true;
  if (lane == 0) ok = wait_geq(ctx.comm, ctx.row_flag(me, kDispatchRows, s, p), epoch, kPhaseDispatchRecv, s);
  __syncwarp();
  if (!__shfl_sync(kFullMask, ok, 0)) return false;

  const int vecs = a.row_bytes / 16;
  const int4* src = reinterpret_cast<const int4*>(ctx.region(me, ctx.ws.data) + s * ctx.ws.slot_bytes +
                                                  (size_t)p * a.row_bytes);
  int4* dst = reinterpret_cast<int4*>(reinterpret_cast<char*>(a.out_x) + row * a.row_bytes);
  for (int first = 0; first < vecs; first += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = first + u * 32 + lane;
      if (i < vecs) v[u] = __ldcg(src + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = first + u * 32 + lane;
      if (i < vecs) dst[i] = v[u];
    }
  }

  const size_t slot_row = (size_t)s * ctx.dims.max_tokens + p;
  if (!a.cached) {
    if (lane < K) {
      const auto* topk = reinterpret_cast<const long long*>(ctx.region(me, ctx.ws.topk));
      const auto* weights = reinterpret_cast<const float*>(ctx.region(me, ctx.ws.weights));
      reinterpret_cast<int64_t*>(a.out_topk_idx)[row * K + lane] = __ldcg(topk + slot_row * K + lane);
      reinterpret_cast<float*>(a.out_topk_weights)[row * K + lane] = __ldcg(weights + slot_row * K + lane);
    }
    if (lane == 0) {
      const auto* src_index = reinterpret_cast<const int*>(ctx.region(me, ctx.ws.src_index));
      reinterpret_cast<int*>(a.out_src_rank)[row] = s;
      reinterpret_cast<int*>(a.out_src_index)[row] = __ldcg(src_index + slot_row);
    }
  }
  const auto* scales = reinterpret_cast<const float*>(ctx.region(me, ctx.ws.scales));
  for (int j = lane; j < S; j += 32) out_scales[row * S + j] = __ldcg(scales + slot_row * S + j);
  return true;
}

__global__ void __launch_bounds__(kThreads, 1)
dispatch_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ DispatchArgs a) {
  const Comm& comm = ctx.comm;
  const int me = comm.rank, R = comm.nranks, T = ctx.dims.max_tokens;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
  const uint64_t ready_epoch = comm.epochs[kSigDispatchReady] + 1;
  const uint64_t epoch = comm.epochs[kSigDispatchDone] + 1;

  // 0. start barrier of a cached dispatch
  bool ok = true;
  if (a.cached) {
    if (blockIdx.x == 0) signal_peers(comm, kSigDispatchReady, ready_epoch);
    ok = wait_peers(comm, kSigDispatchReady, ready_epoch, kPhaseDispatchBarrier);
  }

  if (ok) {
    // 1. send
    if (warp < kSendWarps) {
      const auto* pos = reinterpret_cast<const int*>(a.pos);
      const int first_mine = recv_info[R + me];
      for (int n = blockIdx.x * kSendWarps + warp; n < a.num_tokens; n += gridDim.x * kSendWarps) {
        const int p = lane < R ? pos[(size_t)n * R + lane] : -1;
        const unsigned dests = __ballot_sync(kFullMask, p >= 0);
        if (dests == 0) continue;
        char* row = nullptr;
        size_t meta_row = 0;
        if (p >= 0) {
          if (lane == me) {
            meta_row = (size_t)first_mine + p;
            row = reinterpret_cast<char*>(a.out_x) + meta_row * a.row_bytes;
          } else {
            meta_row = (size_t)me * T + p;
            row = ctx.region(lane, ctx.ws.data) + me * ctx.ws.slot_bytes + (size_t)p * a.row_bytes;
          }
        }
        send_token(ctx, a, n, dests, p, row, meta_row, epoch, lane);
      }
    }

    // 2. receive
    int rows = 0;  // output positions per source to visit
    for (int s = 0; s < R; ++s) rows = max(rows, recv_info[s]);
    if (a.worst_case) rows = T;
    for (;;) {
      const int p = take_work_item(ctx.block_counters + 2);
      if (p >= rows) break;
      bool received = true;
      for (int s = 0; s < R && received; ++s) received = receive_row(ctx, a, s, p, epoch, lane);
      if (!received) break;
    }
  }

  // 3. bookkeeping for the next call
  if (arrive_last(ctx.block_counters + 0)) {
    ctx.block_counters[2] = 0;
    comm.epochs[kSigDispatchDone] = epoch;
    if (a.cached) comm.epochs[kSigDispatchReady] = ready_epoch;
  }
}

}  // namespace

void launch_dispatch(const Context& c, const DispatchArgs& a, uintptr_t stream) {
  dispatch_kernel<<<a.num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(make_device_context(c), a);
  check_launch("moe_ep intranode dispatch kernel");
}

}  // namespace intranode
}  // namespace moe_ep
