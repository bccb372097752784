// Cross-node notify: every rank tells every rank how many tokens it sends there (and its N and its
// per-expert counts), so each rank can size and order its output and all agree on the round count.
//
// Protocol: one block of 1024 threads. epoch = epochs[0] + 1 (the call epoch), set = epoch & 1.
//  1. Thread d (d < R, strided) writes my message for rank d into notify_stage[d] (this rank's
//     symmetric memory): [N, tokens for d, my counts for d's E_l local experts, my call stamp
//     (NotifyArgs::stamp; its status word kStampBadIds if the route kernel before this one, on the
//     same stream, recorded a bad expert id: common/call_stamp.cuh sent_stamp_word)]. __syncthreads.
//  2. Thread d puts that row to row [me] of counts[set] at rank d with one put-with-signal
//     (nvshmem_putmem_signal_nbi, SET notify_sig[me] = epoch). NVSHMEM delivers the row before the
//     signal, on every transport. nvshmem_quiet then completes the puts, so the next call may
//     rewrite notify_stage.
//  3. Thread s waits (comm.h wait_signal_geq: signal fetch, then acquire fence) until notify_sig[s] >=
//     epoch; the block joins. Reads of counts go through L2 (ld.cg).
//  4. A block-wide scan (common/scan.cuh) gives each source's first output row (or s * T in
//     worst-case mode); thread e sums local expert e over the sources; thread 0 takes max N over the
//     sources and writes the round count ceil(max N / C). Results go to recv_info (device) and, when
//     asked, host memory, with every source's stamp (thread s copies source s's) for the host to
//     compare (moe_ep/comm/call_check.py).
//  5. Thread 0 stores epoch into epochs[0].
// Why counts[set] is free when a peer writes it: the peer's notify of call c waits for nothing of
// mine, but my notify of call c - 2 (the last one that read this set) finished before my notify of
// call c - 1 started, and the peer cannot start call c before it has seen my notify signal of c - 1.
// On a timeout every count is taken as 0 (no rows, no rounds) and the host raises CommTimeoutError.
#include "kernels/common/call_stamp.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/scan.cuh"
#include "kernels/internode/internode.h"

namespace moe_ep {
namespace internode {

namespace {

__global__ void __launch_bounds__(kThreads, 1)
notify_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ NotifyArgs a) {
  __shared__ int warp_sums[32];
  __shared__ int max_tokens;
  const Comm& comm = ctx.comm;
  if (block_stamps_disagreed(comm)) return;  // the call's stamp exchange found the ranks' calls differ (comm.h)
  const int tid = threadIdx.x, me = comm.rank, R = comm.nranks;
  const int E_l = ctx.dims.num_local_experts(), CS = ctx.dims.count_stride(), T = ctx.dims.max_tokens;
  const uint64_t epoch = comm.epochs[0] + 1;
  const int set = static_cast<int>(epoch & 1);
  int* stage = ctx.at<int>(ctx.ws.notify_stage);
  int* counts = ctx.at<int>(ctx.ws.counts) + (size_t)set * R * CS;
  uint64_t* notify_sig = ctx.at<uint64_t>(ctx.ws.notify_sig);

  // 1. my message for every rank
  const auto* per_rank = reinterpret_cast<const int*>(a.tokens_per_rank);
  const auto* per_expert = reinterpret_cast<const int*>(a.tokens_per_expert);
  for (int i = tid; i < R * CS; i += kThreads) {
    const int d = i / CS, j = i % CS;
    stage[i] = j == 0           ? a.num_tokens
               : j == 1         ? per_rank[d]
               : j < 2 + E_l    ? per_expert[d * E_l + j - 2]
               : j < 2 + E_l + kStampWords ? sent_stamp_word(comm.error, a.stamp, j - 2 - E_l)
                                : 0;
  }
  __syncthreads();
  // 2. put-with-signal to every rank
  for (int d = tid; d < R; d += kThreads)
    nvshmem_putmem_signal_nbi(counts + (size_t)me * CS, stage + (size_t)d * CS, CS * sizeof(int), notify_sig + me,
                              epoch, NVSHMEM_SIGNAL_SET, d);
  nvshmem_quiet();  // the stage is rewritten by the next call: its puts must have completed
  // 3. everyone's counts for me
  const bool ok = block_wait<true>(comm, notify_sig, R, 1, epoch, kPhaseNodeNotify, [](int s) { return s; });

  // 4. rows and first row per source (block_exclusive_scan over R <= 1024 sources, one per thread)
  auto* recv_info = reinterpret_cast<int*>(a.recv_info);
  auto* host_info = reinterpret_cast<int*>(a.host_info);
  if (tid == 0) max_tokens = 0;
  __syncthreads();
  const int rows = ok && tid < R ? __ldcg(counts + (size_t)tid * CS + 1) : 0;
  if (ok && tid < R) atomicMax(&max_tokens, __ldcg(counts + (size_t)tid * CS));
  int all_rows;
  const int first = block_exclusive_scan(rows, warp_sums, &all_rows);
  if (tid < R) {
    recv_info[tid] = rows;
    recv_info[R + tid] = a.worst_case ? tid * T : first;
    if (host_info != nullptr) {
      host_info[tid] = rows;
      for (int w = 0; w < kStampWords; ++w)
        host_info[R + E_l + tid * kStampWords + w] = ok ? __ldcg(counts + (size_t)tid * CS + 2 + E_l + w) : 0;
    }
  }
  for (int e = tid; e < E_l; e += kThreads) {
    int raw = 0;
    for (int s = 0; ok && s < R; ++s) raw += __ldcg(counts + (size_t)s * CS + 2 + e);
    recv_info[2 * R + e] = raw;
    reinterpret_cast<int*>(a.tokens_per_expert_aligned)[e] =
        (raw + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
    if (host_info != nullptr) host_info[R + e] = raw;
  }
  if (tid == 0) {
    recv_info[2 * R + E_l] = (max_tokens + ctx.dims.round_tokens - 1) / ctx.dims.round_tokens;
    // 5. next call epoch (every thread read it before the barriers above)
    comm.epochs[0] = epoch;
  }
}

}  // namespace

void launch_notify(const Context& c, const NotifyArgs& a, uintptr_t stream) {
  notify_kernel<<<1, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(make_device_context(c), a);
  check_launch("moe_ep internode notify kernel");
}

}  // namespace internode
}  // namespace moe_ep
