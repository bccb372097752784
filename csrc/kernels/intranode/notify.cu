// Notify: the dispatch layout plus the count exchange, which is also the start barrier of a dispatch.
//
// Protocol: G blocks of kLayoutThreads threads (G = ceil(N / kNotifySliceTokens), 1..kMaxNotifyBlocks;
// a template on kK, the bound on K: 8 or 16). epoch = epochs[kSigNotify] + 1 (every block reads it
// first; the last block stores it back last). Context::layout_scratch holds the slices' flags and
// counts and the call's totals (intranode.h).
//  1. Each block takes the next slice s (block counter kNotifySlice, in the order blocks start) of the
//     tokens: [s * P, (s + 1) * P), P = ceil(N / G). layout_counts (dispatch_layout.cuh in this folder)
//     writes the slice's is_token_in_rank and tokens per rank (slice_counts(s)) and adds its tokens
//     per expert into tokens_per_expert (atomics); after its closing __syncthreads, thread 0 fences
//     (cumulative over the block's writes) and stores `epoch` into slice_flag(s).
//  2. The block sums, per rank, the counts of slices 0..s-1 (waiting for each one's flag, then a fence:
//     those slices belong to blocks that started earlier, so the wait ends without any peer) into
//     base[r], and layout_positions writes pos for its slice from base.
//  3. block_arrives_last: the last block to finish its slice goes on alone (fence / counter / fence:
//     every slice's counts, expert totals, is_token_in_rank and pos are in). It sums the slices' counts
//     per rank into tokens_per_rank. For every rank d (this one included) it writes row [me] of counts
//     set [epoch % 2] at d: the number of tokens it sends to d, then its token counts for d's E_l
//     local experts, then this rank's call stamp (NotifyArgs::stamp; its status word kStampBadIds if
//     a block recorded a bad expert id: common/call_stamp.cuh sent_stamp_word) (all threads, one entry
//     each). The block joins, zeroes tokens_per_expert for the next call, and thread d stores `epoch`
//     (st.release.sys, cumulative over the block's stores after __syncthreads) into its kSigNotify
//     flag at d.
//  4. Thread s waits until source s's kSigNotify flag at this rank reaches `epoch` (acquire); the
//     block joins. Thread s < R then derives source s's rows and first output row (prefix sum over
//     the sources before it, or s * T in worst-case mode), thread e sums local expert e's counts over
//     the sources; results go to recv_info and tokens_per_expert (device) and, when asked, to
//     host-mapped memory that the host reads after one stream synchronisation, with every source's
//     stamp (thread s copies source s's), which the host compares (moe_ep/comm/call_check.py).
//  5. Thread 0 stores `epoch` back into epochs[kSigNotify] (kernels on the stream see it next call)
//     and resets the slice counter.
//
// Why this guards the other regions: a rank runs its notify only after its stream finished the
// previous call, which consumed everything peers wrote into its workspace; a peer writes rows into
// this rank's workspace only after it has seen this rank's notify (or ready) flag for the new call.
// The counts are written before that wait, so they alternate between two sets: a peer can start its
// next notify while this rank still reads the current set (when no rows flowed between them), but
// it cannot get two calls ahead, since that next notify waits for this rank's next flag.
// On a timeout the outputs are zero (no rows, offsets s * T or 0), so later kernels touch no memory
// out of bounds; the host raises CommTimeoutError.
#include <algorithm>

#include "kernels/common/call_stamp.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/intranode/dispatch_layout.cuh"
#include "kernels/intranode/intranode.h"

namespace moe_ep {
namespace intranode {

namespace {

template <int kK>
__global__ void __launch_bounds__(kLayoutThreads, 1)
notify_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ NotifyArgs a) {
  const Comm& comm = ctx.comm;
  if (block_stamps_disagreed(comm)) return;  // the call's stamp exchange found the ranks' calls differ (comm.h)
  const int tid = threadIdx.x, me = comm.rank, R = comm.nranks, N = a.num_tokens;
  const int num_local = ctx.dims.num_experts / R, T = ctx.dims.max_tokens, stride = ctx.ws.count_stride;
  const uint64_t epoch = comm.epochs[kSigNotify] + 1;
  __shared__ int slice, base[kMaxNodeRanks];

  // 1. this block's slice of the tokens: its layout, then its flag
  if (tid == 0) slice = atomicAdd(ctx.block_counters + kNotifySlice, 1);
  if (tid < R) base[tid] = 0;
  __syncthreads();
  const int s = slice, per = (N + gridDim.x - 1) / gridDim.x;
  const int begin = min(N, s * per), end = min(N, begin + per);
  LayoutArgs layout;
  layout.topk_idx = a.topk_idx;
  layout.num_tokens = N;
  layout.tokens_per_rank = reinterpret_cast<uintptr_t>(ctx.slice_counts(s));
  layout.tokens_per_expert = reinterpret_cast<uintptr_t>(ctx.tokens_per_expert());
  layout.is_token_in_rank = a.is_token_in_rank;
  layout.pos = a.pos;
  layout_counts<kK, true>(layout, begin, end, ctx.dims.num_topk, ctx.dims.num_experts, R, comm.error);
  if (tid == 0) {
    __threadfence();  // after layout_counts' closing barrier: the whole block's writes, then the flag
    *reinterpret_cast<volatile uint64_t*>(ctx.slice_flag(s)) = epoch;
  }

  // 2. the earlier slices' tokens per rank, then this slice's positions
  for (int i = tid; i < s * R; i += kLayoutThreads) {
    const int q = i / R, r = i % R;
    while (*reinterpret_cast<const volatile uint64_t*>(ctx.slice_flag(q)) < epoch) {
    }
    __threadfence();
    atomicAdd(&base[r], __ldcg(ctx.slice_counts(q) + r));
  }
  layout_positions(layout, begin, end, base, R);

  // 3. the last block: every slice is in; the call's counts and stamp into row [me] of every rank's
  //    counts region, then the flags
  if (!block_arrives_last(ctx.block_counters + kNotifyDone)) return;
  int* tokens_per_rank = ctx.tokens_per_rank();
  int* tokens_per_expert = ctx.tokens_per_expert();
  if (tid < R) {
    int sum = 0;
    for (int q = 0; q < static_cast<int>(gridDim.x); ++q) sum += __ldcg(ctx.slice_counts(q) + tid);
    tokens_per_rank[tid] = sum;
  }
  __syncthreads();
  const int set = static_cast<int>(epoch % 2) * R;  // first row of this call's counts set
  const int row = 1 + num_local + kStampWords;
  for (int i = tid; i < R * row; i += kLayoutThreads) {
    const int d = i / row, j = i % row;
    const int value = j == 0 ? tokens_per_rank[d]
                      : j <= num_local ? __ldcg(tokens_per_expert + d * num_local + j - 1)
                                       : sent_stamp_word(comm.error, a.stamp, j - 1 - num_local);
    reinterpret_cast<int*>(ctx.region(d, ctx.ws.counts))[(set + me) * stride + j] = value;
  }
  __syncthreads();
  for (int e = tid; e < ctx.dims.num_experts; e += kLayoutThreads) tokens_per_expert[e] = 0;  // for the next call
  signal_peers(comm, kSigNotify, epoch);

  // 4. everyone's counts for this rank
  const bool ok = wait_peers(comm, kSigNotify, epoch, kPhaseNotify);
  const int* counts = reinterpret_cast<const int*>(ctx.region(me, ctx.ws.counts)) + set * stride;
  auto* recv_info = reinterpret_cast<int*>(a.recv_info);
  auto* aligned = reinterpret_cast<int*>(a.tokens_per_expert);
  auto* host_info = reinterpret_cast<int*>(a.host_info);
  if (tid < R) {
    int first = 0;
    for (int q = 0; ok && q < tid; ++q) first += __ldcg(counts + q * stride);
    const int rows = ok ? __ldcg(counts + tid * stride) : 0;
    recv_info[tid] = rows;
    recv_info[R + tid] = a.worst_case ? tid * T : first;
    if (host_info != nullptr) {
      host_info[tid] = rows;
      for (int w = 0; w < kStampWords; ++w)
        host_info[R + num_local + tid * kStampWords + w] = ok ? __ldcg(counts + tid * stride + 1 + num_local + w) : 0;
    }
  }
  for (int e = tid; e < num_local; e += kLayoutThreads) {
    int raw = 0;
    for (int q = 0; ok && q < R; ++q) raw += __ldcg(counts + q * stride + 1 + e);
    recv_info[2 * R + e] = raw;
    aligned[e] = (raw + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
    if (host_info != nullptr) host_info[R + e] = raw;
  }

  // 5. next epoch (every block read `epoch` before it arrived; this block's threads before the barrier
  //    inside wait_peers), and the slice counter back at 0 (every block took its slice)
  if (tid == 0) {
    comm.epochs[kSigNotify] = epoch;
    ctx.block_counters[kNotifySlice] = 0;
  }
}

}  // namespace

void launch_notify(const Context& c, const NotifyArgs& a, uintptr_t stream) {
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  const int blocks = std::min(kMaxNotifyBlocks, std::max(1, (a.num_tokens + kNotifySliceTokens - 1) / kNotifySliceTokens));
  if (c.dims.num_topk <= 8)
    notify_kernel<8><<<blocks, kLayoutThreads, 0, st>>>(make_device_context(c), a);
  else
    notify_kernel<kMaxTopk><<<blocks, kLayoutThreads, 0, st>>>(make_device_context(c), a);
  check_launch("moe_ep intranode notify kernel");
}

}  // namespace intranode
}  // namespace moe_ep
