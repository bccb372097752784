// Dispatch: every token row goes once to each rank that holds one of its experts.
//
// Protocol (grid = num_blocks blocks of kThreads; runs after notify on the same stream, which gave
// pos [N, R] and recv_info). epoch = epochs[kSigDispatchDone] + 1 numbers this call's row flags.
// W = Tuning::send_warps (every warp of the block when R = 1: with no peer there is nothing to receive
// but worst-case padding, which the senders fill once their tokens are done), U = Tuning::unroll
// (template parameter), G = Tuning::flag_batch, B = Tuning::recv_run.
//  0. Cached dispatch only (no notify ran): block 0's thread r stores ready_epoch into its
//     kSigDispatchReady flag at peer r; every block waits for all peers' ready flags (start barrier:
//     a peer raises it only after its stream finished the previous call). Then, in every dispatch,
//     thread 0 of each block reads the error word (comm.h ErrorState; one host-mapped load per block):
//     set, the call already failed (notify's count exchange gave up, or an earlier kernel's wait did)
//     and the block's start fails as when its barrier gave up (below): it must not store into peers
//     that may still be in their previous call.
//  1. Send (warps 0..W-1 of every block). Sending warp w owns tokens w, w + W', ... (W' = W * grid),
//     prefetching (into L1) the pos entry of its next token. For token n, lane r < R holds pos[n][r];
//     a ballot gives the destination set. (FP8) The next token's scales row is prefetched into L1
//     too. Lanes < K first load the token's topk id and weight, then
//     the warp loads the row in chunks of U int4 per lane (all loads of a chunk in flight) and stores
//     each chunk to every destination: this rank's output row first[me] + pos (local), or row pos of
//     slot [me] in peer r's data region (NVLink stores through the peer address; with
//     expert_major this rank's own rows go to slot [me] of its own data region instead). The lanes then
//     store the metadata to the same places: topk_idx rewritten to the destination's local expert
//     ids (-1 elsewhere), weights (0 where -1), src_index = n, FP8 scales (own rows also get
//     src_rank). Each peer row's flag, [dispatch][me][pos] at peer r, joins the warp's pending flags
//     (shared memory, up to 32); once G are pending (before a token would overflow 32, and at the
//     end) the warp publishes them: __syncwarp, one fence.acq_rel.sys, then relaxed stores of `epoch`
//     (intranode.h "Row flags", in this folder). A flag is raised only after its row and metadata, and
//     the warp pays one system fence per G flags instead of one per token.
//  2. Receive (the other warps from the start, the sending warps once their tokens are done). Work
//     item k (from a grid-wide counter, taken one ahead: intranode.h WorkItems) is the run of positions
//     [jB, jB + B) of the q-th source visited, j = k / V and q = k % V: in worst-case mode the V = R
//     sources (q = s), else the V = R - 1 peers in rank order (s = q, or q + 1 from q = me on), since
//     this rank's own rows were written by its senders (at R = 1 there is no item). In worst-case mode
//     the run's padding rows (p >= count_s) get zero x and scales, src_rank = src_index = -1,
//     topk_idx = -1, weights = 0 (common/routing.cuh fill_dispatch_rows; on a cached dispatch x and
//     scales only). For peer rows (s != me, p < count_s) lane l waits for the row flag of position
//     jB + l to reach `epoch` (comm.h wait_geq: relaxed polls, then acquire); after __syncwarp (which
//     hands every lane's acquire to the whole warp) the warp copies the run's rows, which are contiguous
//     in slot s and in the output (output rows first[s] + p), as one span with U int4 loads per lane in
//     flight (not with expert_major: the rows stay in slot s for expand.cu, which the host launches
//     next), then the run's metadata spans (topk, weights, src_index, scales; reads through L2: ld.cg)
//     and src_rank = s.
//     Receiving overlaps sending, so peers' rows reach the output while the link is still busy.
//  3. arrive_last: the last block resets the work counter and advances the device epochs.
// Give-up (a wait timed out, or saw the error word set by another thread): every output row then
// holds either what a successful call writes there or poison (fill_dispatch_rows: NaN x, FP8 0x7f
// bytes, NaN scales and weights, topk_idx / src_rank / src_index -1; on a cached dispatch x and
// scales only), so a failed call's output holds no row that looks valid:
//  - a block whose start failed (step 0) sends nothing: its sending warps poison this rank's own
//    rows of their tokens (first[me] + pos), and all its warps take work items only to poison them;
//  - a receiving warp whose wait for a run's rows gave up poisons that run and keeps taking work
//    items only to poison them. Poisoning a run covers its positions p < count_s (all of T in
//    worst-case mode, padding included) except this rank's own rows, which its senders write.
// Outside worst-case mode the output holds exactly the received rows (first[s] + p, recv_info), in
// worst-case mode source s's rows are at [s*T, s*T + count_s). Nothing waits after a give-up, every
// block still arrives (so epochs stay in step) and block 0 of a cached dispatch raised its ready
// flags before its wait; the host raises CommTimeoutError.
#include "kernels/common/launch.cuh"
#include "kernels/common/routing.cuh"
#include "kernels/common/warp.cuh"
#include "kernels/common/warp_copy.cuh"
#include "kernels/intranode/intranode.h"

namespace moe_ep {
namespace intranode {

namespace {

// Row and metadata of token n to every destination in `dests`. Lane r holds destination r's row
// address `row` and its metadata row index `meta_row`.
template <int kU>
__device__ __forceinline__ void send_token(const DeviceContext& ctx, const DispatchArgs& a, int n, unsigned dests,
                                           char* row, int meta_row, int lane) {
  const int me = ctx.comm.rank, K = ctx.dims.num_topk, num_local = ctx.dims.num_experts / ctx.comm.nranks;
  const int S = a.num_scales;

  // topk loads first: their latency hides behind the row copy. notify checked every id of this
  // call, so bad ones map to -1 unrecorded (checked_expert with no error state)
  const LaneRoute route = a.cached ? LaneRoute{-1, 0.f}
                                   : lane_route(a.topk_idx, a.topk_weights, n, K, ctx.dims.num_experts,
                                                nullptr, lane);
  const int expert = route.expert;
  const float weight = route.weight;
  const int4* src = reinterpret_cast<const int4*>(reinterpret_cast<const char*>(a.x) + (size_t)n * a.row_bytes);
  warp_copy<kU>(src, a.row_bytes / 16, lane, LoadNc{}, dests, [&](int r) {  // lane r holds rank r's row address
    return reinterpret_cast<int4*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), r));
  });

  for (unsigned m = dests; m != 0; m &= m - 1) {
    const int r = __ffs(m) - 1;
    const bool local = r == me;
    const size_t at = __shfl_sync(kFullMask, meta_row, r);
    if (!a.cached) {
      if (lane < K) {
        const int id = expert >= r * num_local && expert < (r + 1) * num_local ? expert - r * num_local : -1;
        auto* topk = local ? reinterpret_cast<long long*>(a.out_topk_idx)
                           : reinterpret_cast<long long*>(ctx.region(r, ctx.ws.topk));
        auto* weights = local ? reinterpret_cast<float*>(a.out_topk_weights)
                              : reinterpret_cast<float*>(ctx.region(r, ctx.ws.weights));
        topk[at * K + lane] = static_cast<long long>(id);
        weights[at * K + lane] = id >= 0 ? weight : 0.f;
      }
      if (lane == 0) {
        auto* src_index = local ? reinterpret_cast<int*>(a.out_src_index)
                                : reinterpret_cast<int*>(ctx.region(r, ctx.ws.src_index));
        src_index[at] = n;
        if (local) reinterpret_cast<int*>(a.out_src_rank)[at] = me;
      }
    }
    if (S > 0) {
      const float* in = reinterpret_cast<const float*>(a.x_scales) + (size_t)n * S;
      float* out = (local ? reinterpret_cast<float*>(a.out_scales) : reinterpret_cast<float*>(ctx.region(r, ctx.ws.scales))) +
                   at * S;
      for (int j = lane; j < S; j += 32) out[j] = __ldg(in + j);
    }
  }
}

// The run of positions [p0, p0 + B) of source s: padding (worst case), then peer rows and their
// metadata. Returns false when a wait for a row gave up.
template <int kU>
__device__ __forceinline__ bool receive_run(const DeviceContext& ctx, const DispatchArgs& a, int s, int p0, int B,
                                            int lane) {
  const int me = ctx.comm.rank, R = ctx.comm.nranks, T = ctx.dims.max_tokens, K = ctx.dims.num_topk;
  const int S = a.num_scales;
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
  const int count = recv_info[s];
  const size_t first = recv_info[R + s];
  if (a.worst_case) {
    const int pad0 = max(p0, count), pad1 = min(p0 + B, T);
    if (pad1 > pad0) fill_dispatch_rows(a, K, first + pad0, pad1 - pad0, RowFill::kPadding, lane, 32);
  }
  const int n = min(B, count - p0);
  if (s == me || n <= 0) return true;  // own rows: written by this rank's senders

  bool ok = true;
  if (lane < n)
    ok = wait_geq(ctx.comm, ctx.row_flag(me, kDispatchRows, s, p0 + lane), call_epoch(ctx.comm, kSigDispatchDone),
                   kPhaseDispatchRecv, s);
  __syncwarp();
  if (!__all_sync(kFullMask, ok)) return false;

  const size_t out_row = first + p0, slot_row = (size_t)s * T + p0;
  const char* data = ctx.region(me, ctx.ws.data) + s * ctx.ws.slot_bytes + (size_t)p0 * a.row_bytes;
  if (!a.expert_major)
    warp_copy_cg<kU>(reinterpret_cast<int4*>(reinterpret_cast<char*>(a.out_x) + out_row * a.row_bytes),
                     reinterpret_cast<const int4*>(data), n * (a.row_bytes / 16), lane);
  if (!a.cached) {
    warp_copy_cg<2>(reinterpret_cast<long long*>(a.out_topk_idx) + out_row * K,
                    reinterpret_cast<const long long*>(ctx.region(me, ctx.ws.topk)) + slot_row * K, n * K, lane);
    warp_copy_cg<2>(reinterpret_cast<float*>(a.out_topk_weights) + out_row * K,
                    reinterpret_cast<const float*>(ctx.region(me, ctx.ws.weights)) + slot_row * K, n * K, lane);
    warp_copy_cg<1>(reinterpret_cast<int*>(a.out_src_index) + out_row,
                    reinterpret_cast<const int*>(ctx.region(me, ctx.ws.src_index)) + slot_row, n, lane);
    if (lane < n) reinterpret_cast<int*>(a.out_src_rank)[out_row + lane] = s;
  }
  if (S > 0)
    warp_copy_cg<2>(reinterpret_cast<float*>(a.out_scales) + out_row * S,
                    reinterpret_cast<const float*>(ctx.region(me, ctx.ws.scales)) + slot_row * S, n * S, lane);
  return true;
}

// After a give-up: poison over the positions [p0, p0 + B) of source s that receivers write (rows
// p < count_s, and in worst-case mode the padding up to T), except this rank's own rows, which its
// senders write (rows or poison).
__device__ __forceinline__ void poison_run(const DeviceContext& ctx, const DispatchArgs& a, int s, int p0, int B,
                                           int lane) {
  const int R = ctx.comm.nranks;
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
  const int count = recv_info[s];
  const int begin = s == ctx.comm.rank ? max(p0, count) : p0;
  const int end = min(p0 + B, a.worst_case ? ctx.dims.max_tokens : count);
  __syncwarp();  // after any padding the warp wrote over the same rows
  if (end > begin)
    fill_dispatch_rows(a, ctx.dims.num_topk, (size_t)recv_info[R + s] + begin, end - begin, RowFill::kPoison, lane, 32);
}

template <int kU>
__global__ void __launch_bounds__(kThreads, 1)
dispatch_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ DispatchArgs a) {
  const Comm& comm = ctx.comm;
  if (block_stamps_disagreed(comm)) return;  // the call's stamp exchange found the ranks' calls differ (comm.h)
  const int me = comm.rank, R = comm.nranks, T = ctx.dims.max_tokens;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int send_warps = R == 1 ? kWarps : ctx.tuning.send_warps;  // no peer: no row to receive
  const int batch = ctx.tuning.flag_batch, B = ctx.tuning.recv_run;
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);

  // 0. start barrier of a cached dispatch; then whether the call already failed (notify's count
  //    exchange or an earlier kernel's wait gave up: the error word is set), read once by thread 0
  bool ok = true;
  if (a.cached) {
    const uint64_t ready_epoch = call_epoch(comm, kSigDispatchReady);
    if (blockIdx.x == 0) signal_peers(comm, kSigDispatchReady, ready_epoch);
    ok = wait_peers(comm, kSigDispatchReady, ready_epoch, kPhaseDispatchBarrier);
  }
  ok = __syncthreads_and(ok && (threadIdx.x != 0 || !comm_aborted(comm))) != 0;

  // 1. send; a block whose start failed sends nothing and poisons this rank's own rows of its tokens
  if (warp < send_warps) {
    const auto* pos = reinterpret_cast<const int*>(a.pos);
    const int first_mine = recv_info[R + me], stride = gridDim.x * send_warps;
    if (!ok) {
      for (int n = blockIdx.x * send_warps + warp; n < a.num_tokens; n += stride) {
        const int p = __ldg(pos + (size_t)n * R + me);
        if (p >= 0) fill_dispatch_rows(a, ctx.dims.num_topk, (size_t)first_mine + p, 1, RowFill::kPoison, lane, 32);
      }
    } else {
      __shared__ uint64_t* flag_slots[kWarps][32];
      PendingFlags pending{flag_slots[warp]};
      for (int n = blockIdx.x * send_warps + warp; n < a.num_tokens; n += stride) {
        const int p = lane < R ? __ldg(pos + (size_t)n * R + lane) : -1;
        if (n + stride < a.num_tokens) {  // the next token: its pos entry and FP8 scales into L1
          if (lane == 0) asm volatile("prefetch.global.L1 [%0];" ::"l"(pos + (size_t)(n + stride) * R));
          if (lane * 32 < a.num_scales)  // one lane per 128-byte line of the scales row
            asm volatile("prefetch.global.L1 [%0];" ::"l"(reinterpret_cast<const float*>(a.x_scales) +
                                                           (size_t)(n + stride) * a.num_scales + lane * 32));
        }
        const unsigned dests = __ballot_sync(kFullMask, p >= 0);
        if (dests == 0) continue;
        char* row = nullptr;
        int meta_row = 0;
        if (p >= 0) {
          if (lane == me) {
            meta_row = first_mine + p;
            row = a.expert_major ? ctx.region(me, ctx.ws.data) + me * ctx.ws.slot_bytes + (size_t)p * a.row_bytes
                                      : reinterpret_cast<char*>(a.out_x) + (size_t)meta_row * a.row_bytes;
          } else {
            meta_row = me * T + p;
            row = ctx.region(lane, ctx.ws.data) + me * ctx.ws.slot_bytes + (size_t)p * a.row_bytes;
          }
        }
        send_token<kU>(ctx, a, n, dests, row, meta_row, lane);
        const unsigned peers = dests & ~(1u << me);
        if (pending.count + __popc(peers) > 32) pending.publish(call_epoch(comm, kSigDispatchDone), lane);
        uint64_t* flag = p >= 0 && lane != me ? ctx.row_flag(lane, kDispatchRows, me, p) : nullptr;
        for (unsigned m = peers; m != 0; m &= m - 1) pending.add(flag, __ffs(m) - 1, lane);
        if (pending.count >= batch) pending.publish(call_epoch(comm, kSigDispatchDone), lane);
      }
      pending.publish(call_epoch(comm, kSigDispatchDone), lane);
    }
  }

  // 2. receive; after a give-up (or a failed start) the warp poisons its runs instead. Outside worst-case
  //    mode the sources visited are the peers (this rank's own rows are its senders' work), so at R = 1
  //    no work item is handed out at all
  const int sources = a.worst_case ? R : R - 1;
  int rows = 0;  // output positions per source to visit
  for (int s = 0; s < R; ++s) rows = max(rows, s == me && !a.worst_case ? 0 : recv_info[s]);
  if (a.worst_case) rows = T;
  const int items = (rows + B - 1) / B * sources;
  for (WorkItems work(ctx.block_counters + kDispatchWork);;) {
    const int k = work.next(items);
    if (k >= items) break;
    const int q = k % sources, p0 = k / sources * B;
    const int s = !a.worst_case && q >= me ? q + 1 : q;  // the q-th source visited
    if (ok) ok = receive_run<kU>(ctx, a, s, p0, B, lane);
    if (!ok) poison_run(ctx, a, s, p0, B, lane);
  }

  // 3. bookkeeping for the next call
  if (arrive_last(ctx.block_counters + kDispatchDone)) {
    ctx.block_counters[kDispatchWork] = 0;
    comm.epochs[kSigDispatchDone] = call_epoch(comm, kSigDispatchDone);
    if (a.cached) comm.epochs[kSigDispatchReady] = call_epoch(comm, kSigDispatchReady);
  }
}

}  // namespace

void launch_dispatch(const Context& c, const DispatchArgs& a, uintptr_t stream) {
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  const DeviceContext d = make_device_context(c);
  switch (c.tuning.unroll) {
    case 6: dispatch_kernel<6><<<a.num_blocks, kThreads, 0, st>>>(d, a); break;
    default: dispatch_kernel<4><<<a.num_blocks, kThreads, 0, st>>>(d, a); break;
  }
  check_launch("moe_ep intranode dispatch kernel");
}

}  // namespace intranode
}  // namespace moe_ep
