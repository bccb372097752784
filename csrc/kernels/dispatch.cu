// Dispatch: every token row goes once to each rank that holds one of its experts.
//
// Protocol (grid = num_blocks blocks of kThreads; runs after notify on the same stream, which gave
// pos [N, R] and recv_info):
//  0. Cached dispatch only (no notify ran): block 0's thread r stores ready_epoch into its
//     kSigDispatchReady flag at peer r; every block waits for all peers' ready flags (start barrier:
//     a peer raises it only after its stream finished the previous call).
//  1. Send. Warp w of the grid owns tokens w, w + W, ... (W = warps in the grid). For token n,
//     lane r < R reads pos[n][r]; a ballot gives the destination set. The warp loads the row in
//     chunks of kUnroll int4 per lane (all loads of a chunk in flight), then stores the chunk to each
//     destination: this rank's output row recv_info.first[me] + pos (local), or row pos of slot [me]
//     in peer r's data region (NVLink stores through the peer address). Lanes then write the
//     metadata to the same places: topk_idx rewritten to the destination's local expert ids (-1
//     elsewhere), weights (0 where -1), src_index = n, FP8 scales.
//  2. arrive_last: every thread fences at system scope; the last block to arrive stores done_epoch
//     (release) into its kSigDispatchDone flag at every peer, and advances the device epochs. The
//     fence / counter / fence chain makes that one release cover all blocks' stores.
//  3. Receive. Every block waits for all peers' kSigDispatchDone >= done_epoch (acquire), then the
//     grid's warps walk the output rows, one row per warp: src_rank for every received row, the
//     metadata of peer rows copied from this rank's regions, padding rows (worst case) set to
//     src = -1, topk_idx = -1, weights = 0, scales = 0. Peer metadata is read with ld.cg (L2).
//  4. After the kernel, launch_dispatch enqueues one copy-engine copy per peer source s: slot s of
//     the data region (count_s rows, or all T in worst-case mode) to the output rows of source s.
//     That copy keeps the SMs on the link; the kernel's receive phase already ordered it after the
//     peers' stores.
// A timeout in a wait leaves the kernel early (after counting the block in, so epochs stay in step)
// and suppresses the done flags; the host raises CommTimeoutError.
#include "kernels/intranode.h"

namespace moe_ep {
namespace intranode {

namespace {

constexpr int kUnroll = 4;  // int4 loads in flight per lane

// Where a row and its metadata go at one destination.
struct Destination {
  char* row;        // the row's bytes
  size_t meta_row;  // row index into the destination's metadata arrays
};

// Rows, then metadata, of token n to every destination in `dests` (lane r holds r's Destination).
__device__ __forceinline__ void send_token(const DeviceContext& ctx, const DispatchArgs& a, int n, unsigned dests,
                                           const Destination& mine, int lane) {
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
      int4* dst = reinterpret_cast<int4*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(mine.row), r));
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
    const size_t row = __shfl_sync(kFullMask, static_cast<unsigned long long>(mine.meta_row), r);
    if (!a.cached) {
      if (lane < K) {
        const int64_t id = expert >= 0 && expert / num_local == r ? expert - static_cast<int64_t>(r) * num_local : -1;
        auto* topk = local ? reinterpret_cast<int64_t*>(a.out_topk_idx)
                           : reinterpret_cast<int64_t*>(ctx.region(r, ctx.ws.topk));
        auto* weights = local ? reinterpret_cast<float*>(a.out_topk_weights)
                              : reinterpret_cast<float*>(ctx.region(r, ctx.ws.weights));
        topk[row * K + lane] = id;
        weights[row * K + lane] = id >= 0 ? weight : 0.f;
      }
      if (lane == 0) {
        auto* src_index = local ? reinterpret_cast<int*>(a.out_src_index)
                                : reinterpret_cast<int*>(ctx.region(r, ctx.ws.src_index));
        src_index[row] = n;
      }
    }
    if (a.num_scales > 0) {
      const float* in = reinterpret_cast<const float*>(a.x_scales) + (size_t)n * a.num_scales;
      float* out = local ? reinterpret_cast<float*>(a.out_scales) : reinterpret_cast<float*>(ctx.region(r, ctx.ws.scales));
      for (int j = lane; j < a.num_scales; j += 32) out[row * a.num_scales + j] = in[j];
    }
  }
}

// Output row `row` holds row p of source s (p < count) or is padding (worst case).
__device__ __forceinline__ void receive_metadata(const DeviceContext& ctx, const DispatchArgs& a, int s, int p,
                                                 int count, size_t row, int lane) {
  const int me = ctx.comm.rank, K = ctx.dims.num_topk, S = a.num_scales;
  auto* out_scales = reinterpret_cast<float*>(a.out_scales);
  if (p >= count) {
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
    return;
  }
  if (!a.cached && lane == 0) reinterpret_cast<int*>(a.out_src_rank)[row] = s;
  if (s == me) return;  // the send phase wrote this rank's own rows
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
      reinterpret_cast<int*>(a.out_src_index)[row] = __ldcg(src_index + slot_row);
    }
  }
  const auto* scales = reinterpret_cast<const float*>(ctx.region(me, ctx.ws.scales));
  for (int j = lane; j < S; j += 32) out_scales[row * S + j] = __ldcg(scales + slot_row * S + j);
}

__global__ void __launch_bounds__(kThreads, 1)
dispatch_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ DispatchArgs a) {
  const Comm& comm = ctx.comm;
  const int me = comm.rank, R = comm.nranks, T = ctx.dims.max_tokens;
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32, num_warps = gridDim.x * kWarps;
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
  const uint64_t ready_epoch = comm.epochs[kSigDispatchReady] + 1;
  const uint64_t done_epoch = comm.epochs[kSigDispatchDone] + 1;

  // 0. start barrier of a cached dispatch
  bool ok = true;
  if (a.cached) {
    if (blockIdx.x == 0) signal_peers(comm, kSigDispatchReady, ready_epoch);
    ok = wait_peers(comm, kSigDispatchReady, ready_epoch, kPhaseDispatchBarrier);
  }

  // 1. send
  if (ok) {
    const auto* pos = reinterpret_cast<const int*>(a.pos);
    const int first_mine = recv_info[R + me];
    for (int n = warp; n < a.num_tokens; n += num_warps) {
      const int p = lane < R ? pos[(size_t)n * R + lane] : -1;
      const unsigned dests = __ballot_sync(kFullMask, p >= 0);
      if (dests == 0) continue;
      Destination mine{nullptr, 0};
      if (p >= 0) {
        if (lane == me) {
          mine.meta_row = (size_t)first_mine + p;
          mine.row = reinterpret_cast<char*>(a.out_x) + mine.meta_row * a.row_bytes;
        } else {
          mine.meta_row = (size_t)me * T + p;
          mine.row = ctx.region(lane, ctx.ws.data) + me * ctx.ws.slot_bytes + (size_t)p * a.row_bytes;
        }
      }
      send_token(ctx, a, n, dests, mine, lane);
    }
  }

  // 2. publish
  if (arrive_last(ctx.block_counters + 0)) {
    if (!comm_aborted(comm)) signal_peers_from_one_thread(comm, kSigDispatchDone, done_epoch);
    comm.epochs[kSigDispatchDone] = done_epoch;
    if (a.cached) comm.epochs[kSigDispatchReady] = ready_epoch;
  }
  if (!ok) return;

  // 3. receive metadata
  if (!wait_peers(comm, kSigDispatchDone, done_epoch, kPhaseDispatchRecv)) return;
  for (int s = 0; s < R; ++s) {
    const int count = recv_info[s], first = recv_info[R + s];
    const int rows = a.worst_case ? T : count;
    for (int p = warp; p < rows; p += num_warps) receive_metadata(ctx, a, s, p, count, (size_t)first + p, lane);
  }
}

}  // namespace

void launch_dispatch(const Context& c, const DispatchArgs& a, uintptr_t stream) {
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  dispatch_kernel<<<a.num_blocks, kThreads, 0, st>>>(make_device_context(c), a);
  check_launch("moe_ep intranode dispatch kernel");
  const int me = c.dims.rank, T = c.dims.max_tokens;
  const char* data = reinterpret_cast<const char*>(c.workspace[me]) + c.ws.data;
  size_t first = 0;
  for (int s = 0; s < c.dims.nranks; ++s) {
    const size_t rows = a.worst_case ? T : a.host_counts[s];
    const size_t at = a.worst_case ? (size_t)s * T : first;
    first += rows;
    if (s == me || rows == 0) continue;
    MOE_EP_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<char*>(a.out_x) + at * a.row_bytes, data + s * c.ws.slot_bytes,
                                      rows * a.row_bytes, cudaMemcpyDeviceToDevice, st));
  }
}

}  // namespace intranode
}  // namespace moe_ep
