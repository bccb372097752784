// Cross-node dispatch: each token crosses the network once per destination node, to the rank of the
// same local index there (the forwarder), which stores it over NVLink into the ranks of that node
// that hold its experts; they place it at its final output row (source rank, then token order).
//
// Protocol (grid = Q blocks of 1024 threads, the same Q on every rank, after notify on the same
// stream, which left the round count in recv_info; notify's count exchange is also the start barrier:
// every rank passed it only after every rank finished its previous call). A cached dispatch has no
// notify and starts with internode.h start_barrier instead. Block q is channel q: it runs every
// round r (epoch e = epochs[1] + r + 1, set e & 1, its slots [q*S, q*S + S) of the round, i.e. my
// tokens t = r*C + slot) through three steps, each ending in a block barrier:
//  D1 send (this rank as source (n, l)):
//   a. From round 2 on, threads n_d < N_n wait until rdma_credit[n_d][q] >= e - 2 (the forwarder in
//      node n_d finished the round that last used this set: its buffer and my staging of this set
//      are free; NVSHMEM signal fetch + acquire fence), then threads j < L until nvl_credit[j][q] >=
//      e - 2 (local rank j finished reading the nvl area of that round; NVLink flag, acquire).
//   b. Warp per token: the row (and FP8 scales) into send_row[set][slot]; for each destination node
//      its RowMeta (tag e, token index, local mask and positions of the node's ranks from pos,
//      global topk ids and weights) into send_meta[set][n_d][slot].
//   c. Half the warps take (n_d, slot) items and put each row and meta bound for another node n_d to
//      the same slot of rdma_row/rdma_meta[set][n] at (n_d, l) (nvshmemx_putmem_nbi_warp from
//      symmetric staging); meanwhile the other half forward my own node's rows straight from the
//      staging (D2b below), so local copies overlap the network puts. After the barrier thread n_d calls
//      nvshmem_fence (orders this PE's puts to (n_d, l) before what follows) and signal-ops
//      rdma_sig[set][n][q] = e there. So the rows are delivered before the signal (NVSHMEM).
//  D2 forward (this rank as the forwarder of node n for local index l):
//   a. Threads n_s < N_n wait until rdma_sig[set][n_s][q] >= e (signal fetch + acquire fence: the
//      rows of round e are here).
//   b. Warps take (n_s, slot) items of the other nodes (rdma_row/meta; my own node's rows went in
//      D1c, from my staging); a slot whose meta tag is e holds a row of this round: its local mask goes to
//      forward_mask[n_s][token] (combine replays it); if I am in the mask the row goes straight to my
//      output (as in D3b) and its output row to own_row[n_s][token] (combine reads it there), and
//      row and meta are stored (one load, one store per destination) into
//      nvl_row/nvl_meta[set][l][n_s][slot] of every other local rank in the mask (NVLink).
//   c. After the barrier, threads j < L publish nvl_sig[set][l][q] = e at local rank j (fence.acq_rel
//      .sys, then a relaxed store: release), and threads n_s < N_n signal-op rdma_credit[n][q] = e at
//      (n_s, l): every read of this round's rows is done.
//  D3 receive (this rank as a destination, local index l):
//   a. Threads l' < L wait until nvl_sig[set][l'][q] >= e (NVLink flag, acquire).
//   b. Warps take (l', n_s, slot) items for l' != l; a slot whose tag is e is the token of source s = n_s*L + l'
//      at position p = meta.pos[l]: row, scales, local expert ids (-1 where the expert is elsewhere),
//      weights (0 there), token index and s go to output row first[s] + p (ld.cg reads).
//   c. After the barrier threads l' < L publish nvl_credit[l][q] = e at local rank l'.
// Worst-case mode (output rows [0, R*T), source s's at [s*T, s*T + count_s)): the rows no source fills
// are padding, zero x and scales, topk_idx -1, weights 0, src_rank / src_index -1 (on a cached dispatch
// x and scales only: common/routing.cuh fill_dispatch_rows), as the NVLink dispatch writes them. Block
// q writes them for its share of the R*T rows (rows [q*ceil(R*T/Q), (q+1)*ceil(R*T/Q))), one part per
// round between D1 and D2 (while the round's rows travel), or all at the end when there are no rounds.
// No step waits for a later step of any rank, so the rounds cannot deadlock; the channels are
// independent (a block only waits for the same block elsewhere).
// Tags make slots self-describing: a set's previous round has tag e - 2 and a never-used slot 0.
// The last block to finish (arrive_last_verdict) adds the round count to epochs[1] (and advances
// epochs[4] after a cached dispatch).
// Give-up: a wait that times out or sees the error word set (or the cached start barrier giving up)
// makes the block leave the loop: it waits for nothing more and still arrives (epochs stay in step),
// counting itself in as having given up; so does a block whose thread 0 found the error word already
// set when the block started (notify's count exchange gave up, and left no rounds, or an earlier
// kernel did). The last block to arrive, once every block has (so no thread writes output rows any
// more), then writes poison over every output row of the call, all 1024 threads: rows [0, sum of
// count_s) outside worst-case mode, all R*T rows in it; NaN x (FP8: 0x7f bytes), NaN scales and
// weights, topk_idx / src_rank / src_index -1 (on a cached dispatch x and scales only;
// fill_dispatch_rows). Rows that did arrive are poisoned too: their positions come with their meta,
// so the receiving side cannot tell which rows an unfinished round would have filled. A failed call's
// output thus holds no row that looks valid; the host raises CommTimeoutError.
#include "kernels/common/launch.cuh"
#include "kernels/common/routing.cuh"
#include "kernels/common/warp.cuh"
#include "kernels/common/warp_copy.cuh"
#include "kernels/internode/internode.h"

namespace moe_ep {
namespace internode {

namespace {

constexpr int kPutWarps = kWarps / 2;  // D1: warps that put; the others forward my own node's rows

// D1b: token t's row into send_row[set][k], and a RowMeta into send_meta[set][n_d][k] for every
// destination node n_d. The whole warp calls it.
__device__ __forceinline__ void stage_token(const DeviceContext& ctx, const DispatchArgs& a, int t, int k, int set,
                                            uint64_t e, int lane) {
  const int R = ctx.comm.nranks, L = ctx.dims.local, Nn = ctx.nodes(), C = ctx.dims.round_tokens;
  const int K = ctx.dims.num_topk;
  char* row = ctx.at<char>(ctx.ws.send_row) + ((size_t)set * C + k) * ctx.dims.row_stride();
  warp_copy_cg<kCopyUnroll>(reinterpret_cast<int4*>(row),
                            reinterpret_cast<const int4*>(reinterpret_cast<const char*>(a.x) + (size_t)t * a.row_bytes),
                            a.row_bytes / 16, lane);
  if (a.num_scales > 0) {
    const float* in = reinterpret_cast<const float*>(a.x_scales) + (size_t)t * a.num_scales;
    float* out = reinterpret_cast<float*>(row + ctx.dims.scale_offset());
    for (int j = lane; j < a.num_scales; j += 32) out[j] = __ldg(in + j);
  }
  // route checked every id of this call: bad ones map to -1 unrecorded (checked_expert)
  const LaneRoute route = a.cached ? LaneRoute{-1, 0.f}
                                   : lane_route(a.topk_idx, a.topk_weights, t, K, ctx.dims.num_experts,
                                                nullptr, lane);
  const auto* in_node = reinterpret_cast<const bool*>(a.in_node) + (size_t)t * Nn;
  const auto* pos = reinterpret_cast<const int*>(a.pos) + (size_t)t * R;
  for (int nd = 0; nd < Nn; ++nd) {
    if (!in_node[nd]) continue;
    RowMeta* m = ctx.at<RowMeta>(ctx.ws.send_meta) + ((size_t)set * Nn + nd) * C + k;
    const int p = lane < L ? __ldg(pos + nd * L + lane) : -1;
    const unsigned mask = __ballot_sync(kFullMask, p >= 0);
    if (lane < kMaxNodeRanks) m->pos[lane] = p;
    if (lane < kMaxTopk) {
      m->topk[lane] = route.expert;
      m->weights[lane] = route.weight;
    }
    if (lane == 0) {
      m->tag = e;
      m->src_index = t;
      m->local_mask = static_cast<int>(mask);
    }
  }
}

// D3b: the row in nvl slot (l', n_s, k) to its output row, which it returns.
__device__ __forceinline__ int receive_row(const DeviceContext& ctx, const DispatchArgs& a, const RowMeta* m,
                                            const char* row, int s, int lane) {
  const int R = ctx.comm.nranks, me = ctx.comm.rank, K = ctx.dims.num_topk, E_l = ctx.dims.num_local_experts();
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
  const size_t out_row = (size_t)recv_info[R + s] + __ldcg(&m->pos[ctx.local()]);
  warp_copy_cg<kCopyUnroll>(reinterpret_cast<int4*>(reinterpret_cast<char*>(a.out_x) + out_row * a.row_bytes),
                            reinterpret_cast<const int4*>(row), a.row_bytes / 16, lane);
  if (a.num_scales > 0)
    warp_copy_cg<1>(reinterpret_cast<float*>(a.out_scales) + out_row * a.num_scales,
                    reinterpret_cast<const float*>(row + ctx.dims.scale_offset()), a.num_scales, lane);
  if (a.cached) return static_cast<int>(out_row);
  if (lane < K) {
    const int id = __ldcg(&m->topk[lane]);
    const int local = id >= me * E_l && id < (me + 1) * E_l ? id - me * E_l : -1;
    reinterpret_cast<long long*>(a.out_topk_idx)[out_row * K + lane] = local;
    reinterpret_cast<float*>(a.out_topk_weights)[out_row * K + lane] = local >= 0 ? __ldcg(&m->weights[lane]) : 0.f;
  }
  if (lane == 0) {
    reinterpret_cast<int*>(a.out_src_index)[out_row] = __ldcg(&m->src_index);
    reinterpret_cast<int*>(a.out_src_rank)[out_row] = s;
  }
  return static_cast<int>(out_row);
}

// D2b for one slot of source node n_s: if its meta tag is e, record the local mask (and, when I am a
// destination, place the row in my output and record its row), then store row and meta into the nvl
// area of the other local ranks in the mask. The whole warp calls it.
__device__ __forceinline__ void forward_slot(const DeviceContext& ctx, const DispatchArgs& a, const RowMeta* m,
                                             const char* row, int ns, int k, int set, uint64_t e, int lane) {
  const int L = ctx.dims.local, Nn = ctx.nodes(), l = ctx.local(), C = ctx.dims.round_tokens;
  const int RB = ctx.dims.row_stride();
  if (__ldcg(reinterpret_cast<const unsigned long long*>(&m->tag)) != e) return;
  const unsigned mask = static_cast<unsigned>(__ldcg(&m->local_mask));
  const size_t token = (size_t)ns * ctx.dims.max_tokens + __ldcg(&m->src_index);
  if (lane == 0 && !a.cached) reinterpret_cast<int*>(a.forward_mask)[token] = static_cast<int>(mask);
  if ((mask >> l) & 1u) {  // I am a destination too
    const int out_row = receive_row(ctx, a, m, row, ns * L + l, lane);
    if (lane == 0 && !a.cached) reinterpret_cast<int*>(a.own_row)[token] = out_row;
  }
  const unsigned others = mask & ~(1u << l);
  const size_t nvl_slot = (((size_t)set * L + l) * Nn + ns) * C + k;
  warp_copy_to_peers(ctx, ctx.ws.nvl_row + nvl_slot * RB, reinterpret_cast<const int4*>(row), RB / 16, others, lane);
  warp_copy_to_peers(ctx, ctx.ws.nvl_meta + nvl_slot * sizeof(RowMeta), reinterpret_cast<const int4*>(m),
                     sizeof(RowMeta) / 16, others, lane);
}

// Worst-case padding (fill_dispatch_rows): part `part` of `parts` of this block's share of the output
// rows no source fills. Block q's share is rows [q * chunk, (q + 1) * chunk) of the R * T (chunk =
// ceil(R * T / Q)); of those, source s's rows [s*T + count_s, (s+1)*T) are padding. The whole block.
// Not inlined: the round loop that calls it keeps its registers.
__device__ __noinline__ void write_padding_part(const DeviceContext& ctx, const DispatchArgs& a, int part, int parts) {
  const int R = ctx.comm.nranks, T = ctx.dims.max_tokens;
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
  const long long total = (long long)R * T, chunk = (total + gridDim.x - 1) / gridDim.x;
  const long long share = min(total, blockIdx.x * chunk), len = min(total - share, chunk);
  const long long lo = share + len * part / parts, hi = share + len * (part + 1) / parts;
  for (int s = static_cast<int>(lo / T); s < R && (long long)s * T < hi; ++s) {
    const long long pad0 = max(lo, (long long)s * T + recv_info[s]), pad1 = min(hi, (long long)(s + 1) * T);
    if (pad1 > pad0)
      fill_dispatch_rows(a, ctx.dims.num_topk, pad0, pad1 - pad0, RowFill::kPadding, threadIdx.x, blockDim.x);
  }
}

constexpr int kGaveUpBlock = 1 << 16;  // added to the arrival counter by a block that gave up (Q < 2^16)

// The end of the kernel (common/launch.cuh arrive_last, also telling whether any block gave up): every
// thread fences, then thread 0 counts the block in, adding kGaveUpBlock when `gave_up` held in any of
// its threads. Returns, in every thread of the block: 0 when other blocks are still to arrive; in the
// last block to arrive (which resets the counter) 1, or 2 when some block of the grid gave up.
__device__ __forceinline__ int arrive_last_verdict(int* counter, bool gave_up) {
  __shared__ int verdict;
  __threadfence();
  const bool block_gave_up = __syncthreads_or(gave_up) != 0;
  if (threadIdx.x == 0) {
    const int add = 1 + (block_gave_up ? kGaveUpBlock : 0), old = atomicAdd(counter, add);
    verdict = 0;
    if (old % kGaveUpBlock == static_cast<int>(gridDim.x) - 1) {
      __threadfence();
      *counter = 0;
      verdict = old + add >= kGaveUpBlock ? 2 : 1;
    }
  }
  __syncthreads();
  return verdict;
}

__global__ void __launch_bounds__(kThreads, 1)
dispatch_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ DispatchArgs a) {
  const Comm& comm = ctx.comm;
  if (block_stamps_disagreed(comm)) return;  // the call's stamp exchange found the ranks' calls differ (comm.h)
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = comm.nranks, L = ctx.dims.local, Nn = ctx.nodes(), n = ctx.node(), l = ctx.local();
  const int C = ctx.dims.round_tokens, RB = ctx.dims.row_stride(), q = blockIdx.x;
  const size_t M = sizeof(RowMeta);
  const auto* in_node = reinterpret_cast<const bool*>(a.in_node);
  const int rounds = reinterpret_cast<const int*>(a.recv_info)[2 * R + ctx.dims.num_local_experts()];
  const uint64_t base = comm.epochs[1], start_epoch = comm.epochs[4] + 1;
  const Channel ch = my_channel(C);
  const auto same_local = [&](int node) { return node * L + l; };
  const auto in_my_node = [&](int j) { return n * L + j; };

  // whether the call already failed (notify's count exchange or an earlier kernel's wait gave up): thread
  // 0 reads the error word now, the result is used only at the end (so the load's latency is hidden)
  const bool failed_before = tid == 0 && comm_aborted(comm);
  // a cached dispatch has no notify, whose count exchange is otherwise the start barrier
  bool ok = !a.cached || start_barrier(ctx, 1, start_epoch);
  for (int r = 0; ok && r < rounds; ++r) {
    const uint64_t e = base + r + 1;
    const int set = static_cast<int>(e & 1), k0 = ch.first, t0 = r * C + k0;
    const int mine = max(0, min(ch.width, a.num_tokens - t0));  // my tokens in this chunk

    // D1 send (and D2 for my own node's rows, which need no network)
    if (r >= 2)
      ok = block_wait<true>(comm, ctx.word(ctx.ws.rdma_credit, q), Nn, kMaxChannels, e - 2, kPhaseNodeSendCredit,
                            same_local) &&
           block_wait<false>(comm, ctx.word(ctx.ws.nvl_credit, q), L, kMaxChannels, e - 2, kPhaseNodeForwardCredit,
                             in_my_node);
    if (!ok) break;
    for (int i = warp; i < mine; i += kWarps) stage_token(ctx, a, t0 + i, k0 + i, set, e, lane);
    __syncthreads();
    if (warp < kPutWarps) {  // these warps put rows for other nodes ...
      const auto bound = [&](int nd, int i) { return nd != n && i < mine && in_node[(size_t)(t0 + i) * Nn + nd]; };
      put_chunk(ctx.at<char>(ctx.ws.rdma_row) + ((size_t)set * Nn + n) * C * RB,
                [&](int) { return ctx.at<char>(ctx.ws.send_row) + (size_t)set * C * RB; }, RB, Nn, k0, ch.width,
                same_local, bound, warp, kPutWarps);
      put_chunk(ctx.at<char>(ctx.ws.rdma_meta) + ((size_t)set * Nn + n) * C * M,
                [&](int nd) { return ctx.at<char>(ctx.ws.send_meta) + ((size_t)set * Nn + nd) * C * M; }, M, Nn, k0,
                ch.width, same_local, bound, warp, kPutWarps);
    } else {  // ... while the others forward my own node's rows from the staging
      for (int i = warp - kPutWarps; i < mine; i += kWarps - kPutWarps)
        forward_slot(ctx, a, ctx.at<RowMeta>(ctx.ws.send_meta) + ((size_t)set * Nn + n) * C + k0 + i,
                     ctx.at<char>(ctx.ws.send_row) + ((size_t)set * C + k0 + i) * RB, n, k0 + i, set, e, lane);
    }
    __syncthreads();
    for (int nd = tid; nd < Nn; nd += kThreads) {
      nvshmem_fence();
      nvshmemx_signal_op(ctx.word(ctx.ws.rdma_sig, ((size_t)set * Nn + n) * kMaxChannels + q), e, NVSHMEM_SIGNAL_SET,
                         same_local(nd));
    }
    if (a.worst_case) write_padding_part(ctx, a, r, rounds);  // while the round's rows travel

    // D2 forward the other nodes' rows
    ok = block_wait<true>(comm, ctx.word(ctx.ws.rdma_sig, (size_t)set * Nn * kMaxChannels + q), Nn, kMaxChannels, e,
                          kPhaseNodeForwardRecv, same_local);
    if (!ok) break;
    for (int item = warp; item < Nn * ch.width; item += kWarps) {
      const int ns = item / ch.width, k = k0 + item % ch.width;
      if (ns == n) continue;
      const size_t slot = ((size_t)set * Nn + ns) * C + k;
      forward_slot(ctx, a, ctx.at<RowMeta>(ctx.ws.rdma_meta) + slot, ctx.at<char>(ctx.ws.rdma_row) + slot * RB, ns,
                   k, set, e, lane);
    }
    __syncthreads();
    publish_to_node(ctx, ctx.ws.nvl_sig, ((size_t)set * L + l) * kMaxChannels + q, L, e);
    for (int ns = tid; ns < Nn; ns += kThreads)
      nvshmemx_signal_op(ctx.word(ctx.ws.rdma_credit, (size_t)n * kMaxChannels + q), e, NVSHMEM_SIGNAL_SET,
                         same_local(ns));

    // D3 receive
    ok = block_wait<false>(comm, ctx.word(ctx.ws.nvl_sig, (size_t)set * L * kMaxChannels + q), L, kMaxChannels, e,
                           kPhaseNodeDispatchRecv, in_my_node);
    if (!ok) break;
    for (int item = warp; item < L * Nn * ch.width; item += kWarps) {
      const int lp = item / (Nn * ch.width), ns = item / ch.width % Nn, k = k0 + item % ch.width;
      if (lp == l) continue;  // my own forwarding placed those rows in D2
      const size_t slot = (((size_t)set * L + lp) * Nn + ns) * C + k;
      const RowMeta* m = ctx.at<RowMeta>(ctx.ws.nvl_meta) + slot;
      if (__ldcg(reinterpret_cast<const unsigned long long*>(&m->tag)) != e) continue;
      receive_row(ctx, a, m, ctx.at<char>(ctx.ws.nvl_row) + slot * RB, ns * L + lp, lane);
    }
    __syncthreads();
    publish_to_node(ctx, ctx.ws.nvl_credit, (size_t)l * kMaxChannels + q, L, e);
  }

  if (ok && a.worst_case && rounds == 0) write_padding_part(ctx, a, 0, 1);  // no rows anywhere: all padding

  // Give-up: rows cannot be told apart by round on this side (a row's output position travels in its
  // meta), so once every block has arrived, the last one poisons every output row of a failed call.
  const int verdict = arrive_last_verdict(ctx.block_counters + 0, !ok || failed_before);
  if (verdict == 2) {
    const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
    const long long rows = a.worst_case ? (long long)R * ctx.dims.max_tokens : recv_info[2 * R - 1] + recv_info[R - 1];
    fill_dispatch_rows(a, ctx.dims.num_topk, 0, rows, RowFill::kPoison, tid, kThreads);
  }
  if (verdict != 0 && tid == 0) {
    comm.epochs[1] = base + rounds;
    if (a.cached) comm.epochs[4] = start_epoch;
  }
}

}  // namespace

void launch_dispatch(const Context& c, const DispatchArgs& a, uintptr_t stream) {
  dispatch_kernel<<<a.num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(make_device_context(c), a);
  check_launch("moe_ep internode dispatch kernel");
}

}  // namespace internode
}  // namespace moe_ep
