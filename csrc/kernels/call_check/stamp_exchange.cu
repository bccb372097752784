// The stamp exchange (stamp_exchange.h): the first kernel of every call of a native Buffer, on the
// call's stream, so that ranks making different calls find out on the device, in one round trip,
// before any kernel of the call writes to a peer.
//
// Protocol: one block of up to kThreads threads; thread p serves peer p (p < R, strided).
// epoch = *Context::epoch + 1 (every thread reads it first; thread 0 stores it back last), slot =
// epoch & 1.
//  0. If this rank's ErrorState already says kErrorMismatch (an earlier call's exchange found one and
//     the host has not raised it yet), thread 0 sets the verdict word (Context::verdict) to 1 and the
//     block returns: nothing is sent, the epoch stays, and so does every rank's, since each rank's
//     exchange of that call saw every stamp and recorded the same.
//  1. For every peer p != me not masked (Args::masked, fault-tolerant low latency): nvshmem_int_p of
//     this rank's row (the stamp's kStampWords words, then its token count) into row [me] of
//     table[slot] at p, nvshmem_fence (NVSHMEM orders this thread's puts and signal ops to one PE),
//     then nvshmemx_signal_op SET flags[me] = epoch at p. Thread me stores the same row into its own
//     table with plain stores (the host reads it after a mismatch) and signals nothing.
//  2. Thread p != me waits until flags[p] >= epoch here (comm.h wait_signal_geq: signal fetch, then acquire
//     fence), so row [p] of table[slot] holds p's stamp; it compares the first kComparedWords words
//     with this rank's and takes the most tokens. A masked peer is skipped; in fault-tolerant mode a
//     silent one is masked by the wait (comm.h give_up), else the wait records kErrorTimeout and the
//     other waits give up.
//  3. Once every wait returned (__syncthreads), thread 0: if every peer was heard and a stamp differs,
//     ErrorState = {kErrorMismatch, this rank, kPhaseCallStamp, the first such peer, slot} (first record
//     wins); the verdict word = whether ErrorState now says kErrorMismatch (a plain store: the call's
//     later kernels on this stream read it, comm.h block_stamps_disagreed); the host mailbox gets the
//     most tokens; *epoch = epoch.
// Why table[slot] row [s] is not rewritten while this rank reads it: s writes slot `slot` again only
// at epoch + 2, after its exchange of epoch + 1 saw this rank's flag for epoch + 1, which this rank
// raises only in its next exchange, after this one returned. The host reads table[slot] after a
// mismatch (moe_ep/comm/backends/stamp_exchange.py) once the device is idle and before this rank's
// next exchange, to name every rank's call.
#include <cuda_runtime.h>

#include "kernels/call_check/stamp_exchange.h"
#include "runtime/comm.h"
#include "runtime/error_check.h"

namespace moe_ep {
namespace call_check {

namespace {

__global__ void __launch_bounds__(kThreads, 1)
exchange_kernel(const __grid_constant__ Context ctx, const __grid_constant__ Args a) {
  __shared__ int skip, most, differs;
  auto* error = reinterpret_cast<ErrorState*>(ctx.error);
  auto* verdict = reinterpret_cast<int*>(ctx.verdict);
  Comm comm{};
  comm.rank = ctx.rank;
  comm.nranks = ctx.nranks;
  comm.timeout_ns = ctx.timeout_ns;
  comm.error = error;
  comm.verdict = verdict;
  comm.masked = reinterpret_cast<int*>(a.masked);
  const int tid = threadIdx.x, me = ctx.rank, R = ctx.nranks;
  auto* epoch_word = reinterpret_cast<unsigned long long*>(ctx.epoch);
  const uint64_t epoch = *epoch_word + 1;
  const int slot = static_cast<int>(epoch & 1);
  auto* table = reinterpret_cast<int*>(ctx.symmetric);
  auto* flags = reinterpret_cast<uint64_t*>(ctx.symmetric + table_bytes(R));
  if (tid == 0) {
    skip = stamps_disagreed(error);
    if (skip) *verdict = 1;
    most = a.num_tokens;
    differs = R;
  }
  __syncthreads();
  if (skip) return;  // 0.

  // 1. this rank's row to every peer, then its flag
  int* row = table + ((size_t)slot * R + me) * kRowWords;
  for (int p = tid; p < R; p += blockDim.x) {
    if (p == me) {  // this rank's own row: no signal, no wait (step 2 skips it)
      for (int w = 0; w < kStampWords; ++w) row[w] = a.stamp[w];
      row[kRowTokens] = a.num_tokens;
      continue;
    }
    if (peer_masked(comm, p)) continue;
    for (int w = 0; w < kStampWords; ++w) nvshmem_int_p(row + w, a.stamp[w], p);
    nvshmem_int_p(row + kRowTokens, a.num_tokens, p);
    nvshmem_fence();
    nvshmemx_signal_op(flags + me, epoch, NVSHMEM_SIGNAL_SET, p);
  }
  // 2. every peer's row
  bool ok = true;
  for (int p = tid; ok && p < R; p += blockDim.x) {
    if (p == me) continue;  // its stamp is this rank's, its tokens already in `most`
    if (!wait_signal_geq(comm, flags + p, epoch, kPhaseCallStamp, p)) {
      ok = peer_masked(comm, p);  // a masked peer is left out; anything else ends the exchange
      continue;
    }
    const int* theirs = table + ((size_t)slot * R + p) * kRowWords;
    for (int w = 0; w < kComparedWords; ++w)
      if (__ldcg(theirs + w) != a.stamp[w]) atomicMin(&differs, p);
    atomicMax(&most, __ldcg(theirs + kRowTokens));
  }
  // 3. the verdict
  const bool heard_all = __syncthreads_and(ok) != 0;
  if (tid == 0) {
    if (heard_all && differs < R &&
        atomicCAS_system(&error->code, kErrorNone, kErrorMismatch) == kErrorNone) {
      error->rank = me;
      error->phase = kPhaseCallStamp;
      error->peer = differs;
      error->stamp_slot = slot;
      __threadfence_system();
    }
    *verdict = stamps_disagreed(error) ? 1 : 0;
    reinterpret_cast<int*>(ctx.mailbox)[kMailboxMaxTokens] = most;
    *epoch_word = epoch;
  }
}

}  // namespace

void launch_exchange(const Context& c, const Args& a, uintptr_t stream) {
  const int threads = c.nranks >= kThreads ? kThreads : (c.nranks + 31) / 32 * 32;
  exchange_kernel<<<1, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(c, a);
  check_cuda(cudaGetLastError(), "moe_ep stamp exchange kernel");
}

}  // namespace call_check
}  // namespace moe_ep
