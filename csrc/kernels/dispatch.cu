// Dispatch: every token row goes once to each rank that holds one of its experts.
// Two kernels with one protocol: dispatch_kernel (16-byte loads/stores, described here) and
// dispatch_tma_kernel (bulk copies, described above it); launch_dispatch picks per Context::impl.
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
//     peer's row p (p < count_s) is copied, once lane 0 saw its row flag reach `epoch` (wait_flag;
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
  if (lane == 0) ok = wait_flag(ctx.comm, ctx.row_flag(me, kDispatchRows, s, p), epoch, kPhaseDispatchRecv, s);
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

// ---- TMA variant ----
// dispatch_tma_kernel: blocks of kTmaDispatchThreads (one per SM), same start barrier, row flags,
// epochs and workspace regions as dispatch_kernel, so each rank may run either.
//  Warp 0 sends (tma_send in kernels/intranode.h): waves of B_s consecutive tokens, one bulk load of
//   x[n] serving every destination (bulk stores to each peer's slot row pos[n][r] and to this rank's
//   output row first[me] + pos[n][me]); the lanes store the metadata with generic stores, to the
//   same rows of the peers' topk/weights/src_index/scales regions and of this rank's outputs.
//  Warp 1 receives: items k = j * R + s (chunk j of B_r positions of source s) with k = blockIdx.x
//   (mod gridDim.x). Items that only hold padding rows of worst-case mode, or this rank's own rows,
//   are finished on the spot (padding metadata). For a chunk of peer rows: lane l waits for the row
//   flag of position jB_r + l (relaxed poll, then acquire), __syncwarp, then lane 0 issues a proxy
//   fence (the acquired rows become visible to its bulk loads) and bulk-loads the rows into group
//   c % 2; the previous chunk is finished meanwhile: its rows are bulk-stored to output rows
//   first[s] + p and its metadata copied by the lanes (ld.cg, after the same acquire). Before a
//   group is reloaded, wait_read<0> makes sure its stores have read it.
constexpr int kTmaDispatchThreads = 64;

struct DispatchSendPlan {
  const DeviceContext* ctx;
  const DispatchArgs* a;
  int items, width, row_bytes;  // tokens, R, bytes per row
  int first_mine, num_local;

  __device__ __forceinline__ int entry(int n, int r) const {
    return __ldg(reinterpret_cast<const int*>(a->pos) + (size_t)n * width + r);
  }
  __device__ __forceinline__ bool wanted(const int* pos) const {
    bool any = false;
    for (int r = 0; r < width; ++r) any |= pos[r] >= 0;
    return any;
  }
  __device__ __forceinline__ const char* source(int n) const {
    return reinterpret_cast<const char*>(a->x) + (size_t)n * row_bytes;
  }
  template <class F>
  __device__ __forceinline__ void for_each_dest(const int* pos, F&& f) const {
    const int me = ctx->comm.rank;
    for (int r = 0; r < width; ++r) {
      const int p = pos[r];
      if (p < 0) continue;
      if (r == me)
        f(reinterpret_cast<char*>(a->out_x) + ((size_t)first_mine + p) * row_bytes, static_cast<uint64_t*>(nullptr));
      else
        f(ctx->region(r, ctx->ws.data) + me * ctx->ws.slot_bytes + (size_t)p * row_bytes,
          ctx->row_flag(r, kDispatchRows, me, p));
    }
  }
  // Metadata row of token n at destination r: this rank's output row, or row me * T + p of r's regions.
  __device__ __forceinline__ size_t meta_row(int r, int p) const {
    return r == ctx->comm.rank ? (size_t)first_mine + p : (size_t)ctx->comm.rank * ctx->dims.max_tokens + p;
  }
  __device__ __forceinline__ void metadata(int n0, int count, const int (*pos)[kMaxRanks], int lane) const {
    const int me = ctx->comm.rank, R = width, K = ctx->dims.num_topk, S = a->num_scales;
    if (!a->cached) {
      constexpr int kIds = tma::kMaxRows * kMaxTopk / 32;
      const auto* topk = reinterpret_cast<const int64_t*>(a->topk_idx) + (size_t)n0 * K;
      const auto* weights = reinterpret_cast<const float*>(a->topk_weights) + (size_t)n0 * K;
      int64_t id[kIds];
      float weight[kIds];
#pragma unroll
      for (int u = 0; u < kIds; ++u) {
        const int e = lane + 32 * u;
        if (e < count * K) {
          id[u] = __ldg(reinterpret_cast<const long long*>(topk) + e);
          weight[u] = __ldg(weights + e);
        }
      }
#pragma unroll
      for (int u = 0; u < kIds; ++u) {
        const int e = lane + 32 * u;
        if (e >= count * K) continue;
        const int t = e / K, k = e % K;
        for (int r = 0; r < R; ++r) {
          const int p = pos[t][r];
          if (p < 0) continue;
          const bool local = r == me;
          const int64_t rid = id[u] >= 0 && id[u] / num_local == r ? id[u] - static_cast<int64_t>(r) * num_local : -1;
          auto* out_topk = local ? reinterpret_cast<int64_t*>(a->out_topk_idx)
                                 : reinterpret_cast<int64_t*>(ctx->region(r, ctx->ws.topk));
          auto* out_weights = local ? reinterpret_cast<float*>(a->out_topk_weights)
                                    : reinterpret_cast<float*>(ctx->region(r, ctx->ws.weights));
          const size_t at = meta_row(r, p);
          out_topk[at * K + k] = rid;
          out_weights[at * K + k] = rid >= 0 ? weight[u] : 0.f;
        }
      }
      if (lane < count) {
        for (int r = 0; r < R; ++r) {
          const int p = pos[lane][r];
          if (p < 0) continue;
          const bool local = r == me;
          const size_t at = meta_row(r, p);
          auto* src_index = local ? reinterpret_cast<int*>(a->out_src_index)
                                  : reinterpret_cast<int*>(ctx->region(r, ctx->ws.src_index));
          src_index[at] = n0 + lane;
          if (local) reinterpret_cast<int*>(a->out_src_rank)[at] = me;
        }
      }
    }
    if (S > 0) {
      const float* in = reinterpret_cast<const float*>(a->x_scales) + (size_t)n0 * S;
      for (int base = 0; base < count * S; base += 32 * kUnroll) {
        float v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int e = base + 32 * u + lane;
          if (e < count * S) v[u] = __ldg(in + e);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int e = base + 32 * u + lane;
          if (e >= count * S) continue;
          const int t = e / S, j = e % S;
          for (int r = 0; r < R; ++r) {
            const int p = pos[t][r];
            if (p < 0) continue;
            float* out = r == me ? reinterpret_cast<float*>(a->out_scales)
                                 : reinterpret_cast<float*>(ctx->region(r, ctx->ws.scales));
            out[meta_row(r, p) * S + j] = v[u];
          }
        }
      }
    }
  }
};

// Metadata of output rows [row, row + count): padding (worst case) when `slot_row` < 0, else copied
// from slot rows [slot_row, slot_row + count) of this rank's regions, source s.
__device__ __forceinline__ void receive_metadata(const DeviceContext& ctx, const DispatchArgs& a, int s, size_t row,
                                                 long long slot_row, int count, int lane) {
  const int K = ctx.dims.num_topk, S = a.num_scales;
  const bool pad = slot_row < 0;
  if (!a.cached) {
    const auto* topk = reinterpret_cast<const long long*>(ctx.region(ctx.comm.rank, ctx.ws.topk));
    const auto* weights = reinterpret_cast<const float*>(ctx.region(ctx.comm.rank, ctx.ws.weights));
    const auto* src_index = reinterpret_cast<const int*>(ctx.region(ctx.comm.rank, ctx.ws.src_index));
    for (int e = lane; e < count * K; e += 32) {
      reinterpret_cast<int64_t*>(a.out_topk_idx)[row * K + e] = pad ? -1 : __ldcg(topk + slot_row * K + e);
      reinterpret_cast<float*>(a.out_topk_weights)[row * K + e] = pad ? 0.f : __ldcg(weights + slot_row * K + e);
    }
    for (int e = lane; e < count; e += 32) {
      reinterpret_cast<int*>(a.out_src_rank)[row + e] = pad ? -1 : s;
      reinterpret_cast<int*>(a.out_src_index)[row + e] = pad ? -1 : __ldcg(src_index + slot_row + e);
    }
  }
  if (S > 0) {
    const auto* scales = reinterpret_cast<const float*>(ctx.region(ctx.comm.rank, ctx.ws.scales));
    for (int e = lane; e < count * S; e += 32)
      reinterpret_cast<float*>(a.out_scales)[row * S + e] = pad ? 0.f : __ldcg(scales + slot_row * S + e);
  }
}

__device__ __forceinline__ void dispatch_receive_tma(const DeviceContext& ctx, const DispatchArgs& a, char* stages,
                                                     uint64_t* bars, int B, uint64_t epoch) {
  const int me = ctx.comm.rank, R = ctx.comm.nranks, T = ctx.dims.max_tokens, row = a.row_bytes;
  const int lane = threadIdx.x % 32;
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
  int rows = 0;
  for (int s = 0; s < R; ++s) rows = max(rows, recv_info[s]);
  if (a.worst_case) rows = T;
  const int items = (rows + B - 1) / B * R;
  const char* data = ctx.region(me, ctx.ws.data);
  const auto stage = [&](int c, int l) { return stages + (size_t)((c & 1) * B + l) * row; };

  // The next item at or after k with peer rows to copy; padding on the way is written here.
  const auto next = [&](int k) {
    for (; k < items; k += gridDim.x) {
      const int s = k % R, p0 = k / R * B, count = recv_info[s];
      if (a.worst_case && p0 + B > count) {
        const int pad0 = max(p0, count), pad1 = min(p0 + B, T);
        if (pad1 > pad0) receive_metadata(ctx, a, s, (size_t)recv_info[R + s] + pad0, -1, pad1 - pad0, lane);
      }
      if (s != me && p0 < count) return k;
    }
    return items;
  };
  // Waits for the rows of item k, then bulk-loads them into group c % 2. False when a wait gave up.
  const auto start = [&](int k, int c) {
    const int s = k % R, p0 = k / R * B, n = min(B, recv_info[s] - p0);
    bool ok = true;
    if (lane < n) ok = wait_flag(ctx.comm, ctx.row_flag(me, kDispatchRows, s, p0 + lane), epoch, kPhaseDispatchRecv, s);
    __syncwarp();
    if (!__all_sync(kFullMask, ok)) return false;
    if (lane == 0) {
      tma::wait_read<0>();
      tma::fence_global();
      tma::expect(&bars[c & 1], static_cast<uint32_t>(n * row));
      for (int l = 0; l < n; ++l)
        tma::load(stage(c, l), data + s * ctx.ws.slot_bytes + (size_t)(p0 + l) * row, row, &bars[c & 1]);
    }
    return true;
  };
  // Stores the rows of item k (group c % 2) to the output and copies their metadata.
  const auto finish = [&](int k, int c) {
    const int s = k % R, p0 = k / R * B, n = min(B, recv_info[s] - p0);
    const size_t out_row = (size_t)recv_info[R + s] + p0;
    if (lane == 0) {
      tma::wait(&bars[c & 1], (c >> 1) & 1);
      for (int l = 0; l < n; ++l) tma::store(reinterpret_cast<char*>(a.out_x) + (out_row + l) * row, stage(c, l), row);
      tma::commit();
    }
    receive_metadata(ctx, a, s, out_row, (long long)s * T + p0, n, lane);
  };

  int k = next(blockIdx.x);
  bool ok = k >= items || start(k, 0);
  for (int c = 0; ok && k < items; ++c) {
    const int k_next = next(k + gridDim.x);
    const bool ok_next = k_next >= items || start(k_next, c + 1);
    finish(k, c);
    ok = ok_next;
    k = k_next;
  }
  if (lane == 0) tma::wait_done<0>();
  __syncwarp();
}

__global__ void __launch_bounds__(kTmaDispatchThreads, 1)
dispatch_tma_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ DispatchArgs a, int send_rows,
                    int recv_rows) {
  extern __shared__ __align__(128) char stages[];
  __shared__ __align__(8) uint64_t bars[4];  // send groups 0, 1; receive groups 0, 1
  __shared__ int table[4][tma::kMaxRows][kMaxRanks];
  const Comm& comm = ctx.comm;
  const int me = comm.rank, R = comm.nranks, warp = threadIdx.x / 32;
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
  const uint64_t ready_epoch = comm.epochs[kSigDispatchReady] + 1;
  const uint64_t epoch = comm.epochs[kSigDispatchDone] + 1;

  if (threadIdx.x < 4) tma::init_barrier(&bars[threadIdx.x]);
  tma::fence_barrier_init();
  __syncthreads();

  bool ok = true;
  if (a.cached) {
    if (blockIdx.x == 0) signal_peers(comm, kSigDispatchReady, ready_epoch);
    ok = wait_peers(comm, kSigDispatchReady, ready_epoch, kPhaseDispatchBarrier);
  }
  if (ok) {
    if (warp == 0) {
      const DispatchSendPlan plan{&ctx, &a, a.num_tokens, R, a.row_bytes, recv_info[R + me],
                                  ctx.dims.num_experts / R};
      tma_send(plan, stages, bars, table, send_rows, epoch);
    } else {
      dispatch_receive_tma(ctx, a, stages + (size_t)2 * send_rows * a.row_bytes, bars + 2, recv_rows, epoch);
    }
  }

  if (arrive_last(ctx.block_counters + 0)) {
    ctx.block_counters[2] = 0;
    comm.epochs[kSigDispatchDone] = epoch;
    if (a.cached) comm.epochs[kSigDispatchReady] = ready_epoch;
  }
}

}  // namespace

void launch_dispatch(const Context& c, const DispatchArgs& a, uintptr_t stream) {
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  const TmaShape shape = c.impl == Impl::kTma ? tma_shape(c, a.row_bytes, true) : TmaShape{};
  if (shape.send_rows > 0) {
    ensure_dynamic_smem(dispatch_tma_kernel, kTmaSmemBytes, "cudaFuncSetAttribute(moe_ep intranode dispatch TMA kernel)");
    dispatch_tma_kernel<<<a.num_blocks, kTmaDispatchThreads, shape.smem_bytes, st>>>(make_device_context(c), a,
                                                                                    shape.send_rows, shape.recv_rows);
    check_launch("moe_ep intranode dispatch TMA kernel");
    return;
  }
  dispatch_kernel<<<a.num_blocks, kThreads, 0, st>>>(make_device_context(c), a);
  check_launch("moe_ep intranode dispatch kernel");
}

}  // namespace intranode
}  // namespace moe_ep
