// Cross-node combine: every received row goes back to the forwarder of its source (same node), which
// sums the node's rows of a token (float32, ascending local rank, from +0.0, rounded to bf16 once: the
// node's partial) and puts one partial per (token, node) over the network; the source sums the
// partials in ascending node order in float32 and rounds once. Bit for bit the reference backend's
// two-level rule (docs/api.md). With topk_weights, each row's K float32 weights travel in the same
// combine slot as the row (internode.h: after its 2H bytes), so the stores, puts and flags that
// carry a row carry its weights; they are summed in the same order, in float32 throughout (the
// node's weight partial is not rounded).
//
// Protocol (grid = Q blocks of 1024 threads, the same Q on every rank; the same rounds as the dispatch
// that made the handle; block q is channel q: epoch e = epochs[2] + r + 1, set e & 1, slots
// [q*S, q*S + S) of round r). It opens with internode.h start_barrier (kind 0): every rank it
// exchanges data with finished its previous call, so both sets are free.
//  C1 gather (this rank (n, l) as a destination):
//   a. From round 2 on, threads j < L wait until comb_nvl_credit[j][q] >= e - 2 (forwarder j finished
//      reading the round that last used this set; NVLink flag, acquire).
//   b. Threads s < R find, by binary search in src_index (ascending inside source s's rows), the
//      rows of source s whose token lies in this chunk (shared memory). Warps then take those rows
//      and store each into comb_nvl[set][l][n_s][slot] at the forwarder (n, l_s) of its source
//      (NVLink), with weights lanes k < K storing topk_weights[row][k] into the same slot, except
//      rows of sources with my local index: I forwarded those myself, and C2 reads them (and their
//      weights) in place (own_row from the dispatch).
//   c. After the barrier, threads j < L publish comb_nvl_sig[set][l][q] = e at local rank j (release:
//      rows and weights before the flag).
//  C2 reduce (this rank as the forwarder of node n for local index l):
//   a. Threads j < L wait until comb_nvl_sig[set][j][q] >= e (acquire); from round 2 on, threads
//      n_s < N_n wait until comb_credit[n_s][q] >= e - 2 (source (n_s, l) finished reading the
//      partials of the round that last used this set, so comb_stage and its comb_recv are free;
//      signal fetch + acquire fence).
//   b. Warps take (n_s, slot) items whose forward_mask (from the dispatch) is non-zero and sum the
//      rows of the local ranks in the mask, ascending, into comb_stage[set][n_s][slot] (bf16); with
//      weights, lanes k < K sum their weights in the same order into the same slot (float32).
//   c. After the barrier, warps take (n_s, slot) items and put each such partial for another node
//      (the whole combine slot: row and weights, whether or not the call has weights) to
//      comb_recv[set][n][slot] at (n_s, l) (nvshmemx_putmem_nbi_warp; my own node's partials stay
//      in comb_stage, where C3 reads them); after the next barrier thread n_s calls nvshmem_fence and
//      signal-ops comb_recv_sig[set][n][q] = e there (the partials are delivered before the signal),
//      and threads j < L publish comb_nvl_credit[l][q] = e at local rank j.
//  C3 finish (this rank as the source (n, l)):
//   a. Threads n_d < N_n wait until comb_recv_sig[set][n_d][q] >= e (signal fetch + acquire fence).
//   b. Warp per token t of the chunk: out[t] = bf16(sum over the nodes n_d that received t, in
//      ascending order, of float(partial)), from +0.0 (tokens that went nowhere get +0); my own
//      node's partial is read from comb_stage. With weights, lanes k < K also set
//      out_topk_weights[t][k] = the float32 sum from +0.0 of the partials' weight k in the same order.
//   c. After the barrier threads n_d signal-op comb_credit[n][q] = e at (n_d, l).
// As in the dispatch no step waits for a later step of any rank. The last block adds the round count
// to epochs[2] and advances epochs[3]; a timeout leaves the loop and the host raises CommTimeoutError.
#include "kernels/common/bf16_math.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/internode/internode.h"

namespace moe_ep {
namespace internode {

namespace {

constexpr int kSumUnroll = 2;  // int4 positions per lane per summation step (8 floats each)

// dst = bf16(sum over i < count, ascending, of the rows src(i) that are not null, in float32 from
// +0.0), by one warp; rows are read through L2 (another GPU or the NIC wrote them).
template <class Src>
__device__ __forceinline__ void warp_sum_rows(int4* dst, int count, Src src, int vecs, int lane) {
  for (int first = 0; first < vecs; first += 32 * kSumUnroll) {
    float acc[kSumUnroll][8];
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u)
#pragma unroll
      for (int h = 0; h < 8; ++h) acc[u][h] = 0.f;
    for (int i = 0; i < count; ++i) {
      const int4* row = src(i);
      if (row == nullptr) continue;
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u)
        if (first + u * 32 + lane < vecs) add_bf16x8(acc[u], __ldcg(row + first + u * 32 + lane));
    }
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u)
      if (first + u * 32 + lane < vecs) dst[first + u * 32 + lane] = round_bf16x8(acc[u]);
  }
}

// First index in [lo, hi) of the ascending src_index whose value is >= v.
__device__ __forceinline__ int lower_bound(const int* src_index, int lo, int hi, int v) {
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (__ldg(src_index + mid) < v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads, 1)
combine_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ CombineArgs a) {
  __shared__ int row_begin[kMaxGroupRanks], row_end[kMaxGroupRanks];
  const Comm& comm = ctx.comm;
  if (block_stamps_disagreed(comm)) return;  // the call's stamp exchange found the ranks' calls differ (comm.h)
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = comm.nranks, L = ctx.dims.local, Nn = ctx.nodes(), n = ctx.node(), l = ctx.local();
  const int C = ctx.dims.round_tokens, T = ctx.dims.max_tokens, q = blockIdx.x;
  const size_t row_bytes = 2ull * ctx.dims.hidden, slot_bytes = ctx.dims.comb_stride();  // x / out rows, comb_* slots
  const int vecs = static_cast<int>(row_bytes / 16), K = ctx.dims.num_topk, woff = ctx.dims.comb_weights_offset();
  const auto* recv_info = reinterpret_cast<const int*>(a.recv_info);
  const auto* src_index = reinterpret_cast<const int*>(a.src_index);
  const auto* forward_mask = reinterpret_cast<const int*>(a.forward_mask);
  const auto* own_row = reinterpret_cast<const int*>(a.own_row);
  const auto* in_node = reinterpret_cast<const bool*>(a.in_node);
  const char* x = reinterpret_cast<const char*>(a.x);
  const auto* in_w = reinterpret_cast<const float*>(a.topk_weights);
  auto* out_w = reinterpret_cast<float*>(a.out_topk_weights);
  const int rounds = recv_info[2 * R + ctx.dims.num_local_experts()];
  const uint64_t base = comm.epochs[2], start_epoch = comm.epochs[3] + 1;
  const Channel ch = my_channel(C);
  const auto same_local = [&](int node) { return node * L + l; };
  const auto in_my_node = [&](int j) { return n * L + j; };

  bool ok = start_barrier(ctx, 0, start_epoch);
  int r = 0;
  for (; ok && r < rounds; ++r) {
    const uint64_t e = base + r + 1;
    const int set = static_cast<int>(e & 1), k0 = ch.first, lo = r * C + k0;

    // C1 gather
    if (r >= 2)
      ok = block_wait<false>(comm, ctx.word(ctx.ws.comb_nvl_credit, q), L, kMaxChannels, e - 2,
                             kPhaseNodeCombineCredit, in_my_node);
    if (!ok) break;
    for (int s = tid; s < R; s += kThreads) {
      const int first = recv_info[R + s], last = first + recv_info[s];
      row_begin[s] = lower_bound(src_index, first, last, lo);
      row_end[s] = lower_bound(src_index, row_begin[s], last, lo + ch.width);
    }
    __syncthreads();
    for (int s = 0; s < R; ++s) {
      const int ns = s / L, ls = s % L;
      if (ls == l) continue;  // I forwarded these rows myself: C2 reads them from x (own_row)
      for (int j = row_begin[s] + warp; j < row_end[s]; j += kWarps) {
        const int k = __ldg(src_index + j) - r * C;
        const uint64_t slot = ctx.ws.comb_nvl + ((((size_t)set * L + l) * Nn + ns) * C + k) * slot_bytes;
        const bool weighs = a.with_weights && lane < K;
        const float weight = weighs ? __ldg(in_w + (size_t)j * K + lane) : 0.f;
        warp_copy_to_peers(ctx, slot, reinterpret_cast<const int4*>(x + (size_t)j * row_bytes), vecs, 1u << ls, lane);
        if (weighs) ctx.at_peer<float>(ls, slot + woff)[lane] = weight;
      }
    }
    __syncthreads();
    publish_to_node(ctx, ctx.ws.comb_nvl_sig, ((size_t)set * L + l) * kMaxChannels + q, L, e);

    // C2 reduce
    ok = block_wait<false>(comm, ctx.word(ctx.ws.comb_nvl_sig, (size_t)set * L * kMaxChannels + q), L,
                           kMaxChannels, e, kPhaseNodeCombineGather, in_my_node);
    if (ok && r >= 2)
      ok = block_wait<true>(comm, ctx.word(ctx.ws.comb_credit, q), Nn, kMaxChannels, e - 2, kPhaseNodeCombineCredit,
                            same_local);
    if (!ok) break;
    for (int item = warp; item < Nn * ch.width; item += kWarps) {
      const int ns = item / ch.width, k = k0 + item % ch.width, t = r * C + k;
      const size_t token = (size_t)ns * T + t;
      const unsigned mask = t < T ? static_cast<unsigned>(__ldg(forward_mask + token)) : 0u;
      if (mask == 0) continue;
      char* stage = ctx.at<char>(ctx.ws.comb_stage) + (((size_t)set * Nn + ns) * C + k) * slot_bytes;
      // local rank j's slot in comb_nvl (j != l: I read my own rows and weights in place, at own_row)
      const auto gathered = [&](int j) {
        return ctx.at<char>(ctx.ws.comb_nvl) + ((((size_t)set * L + j) * Nn + ns) * C + k) * slot_bytes;
      };
      warp_sum_rows(
          reinterpret_cast<int4*>(stage), L,
          [&](int j) -> const int4* {
            if (!((mask >> j) & 1u)) return nullptr;
            if (j == l) return reinterpret_cast<const int4*>(x + (size_t)__ldg(own_row + token) * row_bytes);
            return reinterpret_cast<const int4*>(gathered(j));
          },
          vecs, lane);
      if (a.with_weights)
        warp_sum_weights(
            reinterpret_cast<float*>(stage + woff), L,
            [&](int j) -> const float* {
              if (!((mask >> j) & 1u)) return nullptr;
              if (j == l) return in_w + (size_t)__ldg(own_row + token) * K;
              return reinterpret_cast<const float*>(gathered(j) + woff);
            },
            K, lane);
    }
    __syncthreads();
    put_chunk(ctx.at<char>(ctx.ws.comb_recv) + ((size_t)set * Nn + n) * C * slot_bytes,
              [&](int ns) { return ctx.at<char>(ctx.ws.comb_stage) + ((size_t)set * Nn + ns) * C * slot_bytes; },
              slot_bytes, Nn, k0, ch.width, same_local, [&](int ns, int i) {
                return ns != n && lo + i < T && __ldg(forward_mask + (size_t)ns * T + lo + i) != 0;
              });
    __syncthreads();
    for (int ns = tid; ns < Nn; ns += kThreads) {
      nvshmem_fence();
      nvshmemx_signal_op(ctx.word(ctx.ws.comb_recv_sig, ((size_t)set * Nn + n) * kMaxChannels + q), e,
                         NVSHMEM_SIGNAL_SET, same_local(ns));
    }
    publish_to_node(ctx, ctx.ws.comb_nvl_credit, (size_t)l * kMaxChannels + q, L, e);

    // C3 finish
    ok = block_wait<true>(comm, ctx.word(ctx.ws.comb_recv_sig, (size_t)set * Nn * kMaxChannels + q), Nn,
                          kMaxChannels, e, kPhaseNodeCombineRecv, same_local);
    if (!ok) break;
    const int mine = max(0, min(ch.width, a.num_tokens - lo));
    for (int i = warp; i < mine; i += kWarps) {
      const int t = lo + i, k = k0 + i;
      // node n_d's partial slot for token t, or nullptr where t did not go to n_d; my node's partials
      // never left this rank (comb_stage)
      const auto partial = [&](int nd) -> const char* {
        if (!in_node[(size_t)t * Nn + nd]) return nullptr;
        return ctx.at<char>(nd == n ? ctx.ws.comb_stage : ctx.ws.comb_recv) +
               (((size_t)set * Nn + nd) * C + k) * slot_bytes;
      };
      warp_sum_rows(
          reinterpret_cast<int4*>(reinterpret_cast<char*>(a.out) + (size_t)t * row_bytes), Nn,
          [&](int nd) { return reinterpret_cast<const int4*>(partial(nd)); }, vecs, lane);
      if (a.with_weights)
        warp_sum_weights(
            out_w + (size_t)t * K, Nn,
            [&](int nd) -> const float* {
              const char* p = partial(nd);
              return p == nullptr ? nullptr : reinterpret_cast<const float*>(p + woff);
            },
            K, lane);
    }
    __syncthreads();
    for (int nd = tid; nd < Nn; nd += kThreads)
      nvshmemx_signal_op(ctx.word(ctx.ws.comb_credit, (size_t)n * kMaxChannels + q), e, NVSHMEM_SIGNAL_SET,
                         same_local(nd));
  }

  // After a wait gave up (round r on): NaN over this block's tokens of the rounds it did not finish
  // (rows and weights), so the failed call's output holds no row that looks valid.
  for (r = ok ? rounds : r; r < rounds; ++r) {
    const int lo = r * C + ch.first, mine = max(0, min(ch.width, a.num_tokens - lo));
    for (int i = tid; i < mine * vecs; i += kThreads)
      reinterpret_cast<int4*>(a.out)[(size_t)(lo + i / vecs) * vecs + i % vecs] = bf16_nan_x8();
    if (a.with_weights)
      for (int i = tid; i < mine * K; i += kThreads) out_w[(size_t)lo * K + i] = f32_nan();
  }
  if (arrive_last(ctx.block_counters + 1)) {
    comm.epochs[2] = base + rounds;
    comm.epochs[3] = start_epoch;
  }
}

}  // namespace

void launch_combine(const Context& c, const CombineArgs& a, uintptr_t stream) {
  combine_kernel<<<a.num_blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(make_device_context(c), a);
  check_launch("moe_ep internode combine kernel");
}

}  // namespace internode
}  // namespace moe_ep
