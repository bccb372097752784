// Notify: the dispatch layout plus the count exchange, which is also the start barrier of a dispatch.
//
// Protocol: one block of kLayoutThreads threads (a template on kK, the bound on K: 8 or 16).
//  1. layout_counts (dispatch_layout.cuh in this folder): tokens per rank and per expert into
//     Context::layout_scratch, and is_token_in_rank.
//  2. epoch = epochs[kSigNotify] + 1. For every rank d (this one included), the block writes row
//     [me] of counts set [epoch % 2] at d: the number of tokens it sends to d, then its token counts
//     for d's E_l local experts, then this rank's call stamp (NotifyArgs::stamp; its status word
//     kStampBadIds if step 1 recorded a bad expert id: common/call_stamp.cuh sent_stamp_word, after
//     a __syncthreads that makes step 1's record visible to every thread) (all threads, one entry
//     each). The block joins (__syncthreads orders every thread's stores before the release below,
//     which is cumulative), then thread d stores `epoch` (st.release.sys) into its kSigNotify flag at d.
//  2b. layout_positions: pos for the dispatch, from is_token_in_rank, while the flags travel.
//  3. Thread s waits until source s's kSigNotify flag at this rank reaches `epoch` (acquire); the
//     block joins. Thread s < R then derives source s's rows and first output row (prefix sum over
//     the sources before it, or s * T in worst-case mode), thread e sums local expert e's counts over
//     the sources; results go to recv_info and tokens_per_expert (device) and, when asked, to
//     host-mapped memory that the host reads after one stream synchronisation, with every source's
//     stamp (thread s copies source s's), which the host compares (moe_ep/comm/call_check.py).
//  4. Thread 0 stores `epoch` back into epochs[kSigNotify] (kernels on the stream see it next call).
//
// Why this guards the other regions: a rank runs its notify only after its stream finished the
// previous call, which consumed everything peers wrote into its workspace; a peer writes rows into
// this rank's workspace only after it has seen this rank's notify (or ready) flag for the new call.
// The counts are written before that wait, so they alternate between two sets: a peer can start its
// next notify while this rank still reads the current set (when no rows flowed between them), but
// it cannot get two calls ahead, since that next notify waits for this rank's next flag.
// On a timeout the outputs are zero (no rows, offsets s * T or 0), so later kernels touch no memory
// out of bounds; the host raises CommTimeoutError.
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
  const int tid = threadIdx.x, me = comm.rank, R = comm.nranks;
  const int num_local = ctx.dims.num_experts / R, T = ctx.dims.max_tokens, stride = ctx.ws.count_stride;
  int* tokens_per_rank = ctx.layout_scratch;
  int* tokens_per_expert = ctx.layout_scratch + R;

  // 1. layout
  LayoutArgs layout;
  layout.topk_idx = a.topk_idx;
  layout.num_tokens = a.num_tokens;
  layout.tokens_per_rank = reinterpret_cast<uintptr_t>(tokens_per_rank);
  layout.tokens_per_expert = reinterpret_cast<uintptr_t>(tokens_per_expert);
  layout.is_token_in_rank = a.is_token_in_rank;
  layout.pos = a.pos;
  layout_counts<kK>(layout, ctx.dims.num_topk, ctx.dims.num_experts, R, ctx.comm.error);
  __syncthreads();  // every thread's bad-id record (if any) is in before the stamps are sent

  // 2. my counts and stamp into row [me] of every rank's counts region, then the flags
  const uint64_t epoch = comm.epochs[kSigNotify] + 1;
  const int set = static_cast<int>(epoch % 2) * R;  // first row of this call's counts set
  const int row = 1 + num_local + kStampWords;
  for (int i = tid; i < R * row; i += kLayoutThreads) {
    const int d = i / row, j = i % row;
    const int value = j == 0 ? tokens_per_rank[d]
                      : j <= num_local ? tokens_per_expert[d * num_local + j - 1]
                                       : sent_stamp_word(comm.error, a.stamp, j - 1 - num_local);
    reinterpret_cast<int*>(ctx.region(d, ctx.ws.counts))[(set + me) * stride + j] = value;
  }
  __syncthreads();
  signal_peers(comm, kSigNotify, epoch);
  layout_positions(layout, R);

  // 3. everyone's counts for this rank
  const bool ok = wait_peers(comm, kSigNotify, epoch, kPhaseNotify);
  const int* counts = reinterpret_cast<const int*>(ctx.region(me, ctx.ws.counts)) + set * stride;
  auto* recv_info = reinterpret_cast<int*>(a.recv_info);
  auto* aligned = reinterpret_cast<int*>(a.tokens_per_expert);
  auto* host_info = reinterpret_cast<int*>(a.host_info);
  if (tid < R) {
    int first = 0;
    for (int s = 0; ok && s < tid; ++s) first += __ldcg(counts + s * stride);
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
    for (int s = 0; ok && s < R; ++s) raw += __ldcg(counts + s * stride + 1 + e);
    recv_info[2 * R + e] = raw;
    aligned[e] = (raw + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
    if (host_info != nullptr) host_info[R + e] = raw;
  }

  // 4. next epoch (every thread read `epoch` before the barrier inside wait_peers)
  if (tid == 0) comm.epochs[kSigNotify] = epoch;
}

}  // namespace

void launch_notify(const Context& c, const NotifyArgs& a, uintptr_t stream) {
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  if (c.dims.num_topk <= 8)
    notify_kernel<8><<<1, kLayoutThreads, 0, st>>>(make_device_context(c), a);
  else
    notify_kernel<kMaxTopk><<<1, kLayoutThreads, 0, st>>>(make_device_context(c), a);
  check_launch("moe_ep intranode notify kernel");
}

}  // namespace intranode
}  // namespace moe_ep
