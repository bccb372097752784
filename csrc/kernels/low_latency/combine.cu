// Low-latency combine: each rank pushes every expert output row it holds back to the rank that owns
// the token (NVLink stores to ranks of this node, NVSHMEM puts to ranks of other nodes), then every
// rank sums its tokens' rows in ascending k.
//
// What travels: one bf16 row per (token, distinct expert), written at the owner into the combine
// staging slot (token, first k naming that expert). No partial sums per (token, rank): the result
// is bf16(((0 + w0*r0) + w1*r1) + ...) in ascending k and float addition is not associative, so a
// partial sum made on an expert's rank is exact only where it is a prefix of that chain (or the
// whole chain). It would also need the weights, which only the owner has (one more round trip), and
// a float32 partial costs the bytes of two bf16 rows, so it would pay only for a prefix of three or
// more experts on one remote rank, which random top-k routing rarely produces. So rows travel and
// the owner does every multiply and add in the fixed order. For the L1 shape (top-8 of 256, 2 ranks)
// that is ~4 remote rows per token: 128 tokens send 7.3 MB each way, ~19-21 us at 350-390 GB/s.
//
// Protocol: one kernel, `combine`, with a send half and a receive half, launched as the dispatch
// kernel is (dispatch.cu in this folder: one launch for both halves, or the send half and then the
// receive half in hook(); grid G = kernel_blocks, all blocks resident). Node ranks / net ranks as
// in dispatch.cu (from ranks_per_node). The send half is written for G virtual blocks b < G: without
// overlap the launched block b is virtual block b; with overlap (below) fewer blocks run them all.
//
// Send half — items (p, e), local expert e, part p < P; virtual block b serves items b, b + G, ...
//   Reads the call's epoch e = epochs[10] + 1 and uses set e & 1. All blocks together first copy
//   this rank's topk_idx / topk_weights into a private stash (the receive half may run later, after
//   the caller reused its tensors). The item's rows m = p + P * r < count[e] are cut into 4 KB
//   chunks, and the (row, chunk) items are spread over all the block's warps: a warp loads its chunk
//   of y[e][m] (8 int4 per lane, in flight together with the row's src_* loads) and stores it to the
//   combine staging [set][src_index][src_k] of rank src_rank[e][m] through its NVLink address when
//   that rank is in the node, so each warp pays about one memory round trip per item. With several
//   nodes the rows go in rounds of 8: a row for a net rank is stored instead into this item's
//   scratch row (r mod 8) in the own region (symmetric memory: a put's source must be registered
//   for every transport, and y is a user tensor); after a block barrier, warp w takes the round's
//   rows w, w + 16, ...: one fence.acq_rel.sys (the barrier's scratch stores are performed at system
//   scope before the transport reads them), then nvshmemx_putmem_nbi_warp of the row (2H bytes) to
//   the same staging slot at that rank. Before a further round rewrites the scratch, a barrier and
//   nvshmem_quiet() on thread 0 (another barrier after it) complete those puts (NVSHMEM's quiet
//   guarantee: done with the source). After each virtual block's items, finish_send_block
//   (low_latency.h, counting G blocks): block barrier, thread 0
//   calls nvshmem_quiet() (several nodes: this block's puts are complete at their targets), issues
//   one fence.acq_rel.sys and adds 1 (relaxed) to node signal [2 + (e & 1)][me] at every node rank;
//   the last block (local counter) writes epochs[10] = e and, with several nodes, sets net signal
//   [5][me] = e at every net rank by nvshmemx_signal_op (after every block's quiet: all of this
//   call's puts to that rank are complete).
// Overlap (SGLang's single-batch overlap on Hopper: the combine starts while DeepGEMM's masked GEMM,
//   persistent on the other SMs, still writes y). The call passes comp_signal (int32, one word per
//   (local expert e, block j of block_m rows): [e * signal_blocks + j], signal_blocks =
//   ceil(R*T / block_m)), threshold and num_sms. The GEMM adds to word (e, j) with release semantics
//   (at least gpu scope) after its stores of those rows of y; the word reaches threshold once every
//   one of its adds for the block is in. Both launches of the call run min(num_sms, G) blocks
//   (never more: a block spinning on an SM the GEMM waits for would deadlock it; for the same reason
//   every kernel that writes y or comp_signal must already be loaded when the combine launches: with
//   CUDA's lazy loading, the default, a kernel's first launch may wait for the context's running
//   kernels, so it would wait for this one, which waits for it, until the timeout), and launched block
//   i runs the virtual send blocks i, i + gridDim, ... < G one after the other, each exactly as
//   above (the same items, its own finish_send_block). So every rank still adds G to each peer's
//   node counter per epoch and the last of G local counts publishes the epoch: receivers count as
//   without overlap, on every rank, whichever ranks overlap. Before a thread loads its part of row m
//   of expert e it waits (relaxed polls at gpu scope, then one ld.acquire.gpu, pairing with the
//   GEMM's release add: the rows' stores are visible to its later loads) until word (e, m / block_m)
//   >= threshold; each thread remembers the last block it acquired (rows of a warp ascend), so it
//   loads that word about once per block. It never waits for anything else in the send half, so
//   sends start per expert and block as the GEMM finishes them. A wait that passes the timeout
//   records ErrorState (this rank, phase LowLatencyCombineWaitCompute; no masking, it is no peer)
//   and the thread sends NaN in place of the row (later waits see the abort and do the same): the
//   protocol completes on every rank, the rows that could not be read arrive as NaN, and this
//   rank's host raises CommTimeoutError.
// Receive half — items (token n, 512-int4 column group), launched block i serves items i, i + gridDim,
//   ...; thread = 8 channels (no counts here, so the launched blocks need no virtual ones). A
//   receive-only launch reads e = epochs[10]. wait_all_sources, once per
//   block and also with N == 0 (low_latency.h; timeout -> ErrorState naming rank, peer and phase
//   LowLatencyCombineRecv; the block then writes NaN over its items' outputs): a node rank until
//   its block counter in node signal [2 + (e & 1)][r] reaches G * ((e + 1) / 2) (every send block
//   of every epoch of this parity up to e; G is the same on every rank; relaxed polls, then an
//   acquire load), a net rank until net signal [5][r] >= e (nvshmem_signal_fetch, then an acquire
//   fence); a barrier hands the staged rows (and, in a launch with both halves, the stash written
//   by every block of this rank before it arrived) to the block.
//   Per item, threads k < K put the stashed id, weight and first-k slot of k in shared memory
//   (a masked rank's experts get no slot: fault-tolerant mode). Each thread
//   loads its 16 bytes of every valid k's row (all loads in flight), then acc = +0.0 and, for k
//   ascending with id != -1, acc = __fadd_rn(acc, __fmul_rn(w, float(row))): explicit roundings,
//   so no FMA can be contracted; bf16 round-to-nearest-even once at the end.
//
// Reuse of a staging set: rank s writes set (e & 1) at rank d in its combine send of epoch e; d
// last read it in its combine receive of e - 2, which precedes d's send of e - 1, whose completion
// s waits for in its receive of e - 1, before its send of e (every receive waits for every rank).
// The same chain keeps epoch e + 2's adds out of the node block counter until d's receive of e has
// read it; a net signal only grows. This needs a combine's receive half to run before the next
// combine's send half; the engine enforces that hook() is called before the next
// low_latency_combine. The stash and the scratch are single: the send of the next combine follows
// this combine's receive in the stream, and this send's puts are complete when it ends (quiet).
// Within a launch running both halves a block's receive half waits for every block's send half,
// this rank's included; all launched blocks are resident (cooperative launch) and each finishes all
// of its virtual send blocks before its receive half, so that cannot deadlock, with overlap too.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/low_latency/low_latency.h"

namespace moe_ep {
namespace ll {
// The kernel's argument (outside the anonymous namespace, like the kernel, so that profilers show
// the kernel as moe_ep::ll::combine<...>).
struct CombineArgs {
  Peers peers;
  // send half
  uint64_t payload_offset;  // combine payload area (set 0) in every rank's region
  int4* scratch;            // this rank's combine scratch [P * E_l][kScratchRows][H] bf16 (several nodes)
  const int4* y;            // [E_l, R*T, H] bf16
  const int* src_rank;
  const int* src_index;
  const int* src_k;
  const int* count;
  const int64_t* topk_idx;  // [N, K] of this rank's tokens
  const float* topk_weights;
  int64_t* stash_idx;       // [T*K]
  float* stash_weights;     // [T*K]
  int* done;
  // receive half
  const int4* payload;  // this rank's combine payload area
  uint4* out;           // [N, H] bf16
  // overlap (file comment): the send half reads row m of expert e once comp_signal[e * signal_blocks +
  // m / block_m] >= threshold
  const int* comp_signal;  // [E_l * signal_blocks] int32, or null: no waits
  int block_m;
  int threshold;
  int signal_blocks;  // ceil(R*T / block_m)
  int grid;           // G = kernel_blocks: the send half's virtual blocks (peers count them)
  int num_tokens;
  int num_topk;
  int hidden;
  int max_tokens;
  int num_local_experts;
  int blocks_per_expert;  // P
  bool send;              // run the send half
  bool receive;           // run the receive half
};

namespace {

// Byte offset of staging slot (token t, k) of set `set` in the combine payload area.
__device__ __forceinline__ size_t staging_at(const CombineArgs& a, int set, int t, int k) {
  return a.payload_offset +
         ((static_cast<size_t>(set) * a.max_tokens + t) * a.num_topk + k) * 2 * static_cast<size_t>(a.hidden);
}

// The stash: this rank's topk ids and weights, copied by all blocks together (grid-stride).
__device__ __forceinline__ void stash_routing(const CombineArgs& a) {
  const int stash_n = a.num_tokens * a.num_topk;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < stash_n; i += gridDim.x * blockDim.x) {
    a.stash_idx[i] = a.topk_idx[i];
    a.stash_weights[i] = a.topk_weights[i];
  }
}

// Overlap: whether this thread may read rows [j * block_m, (j + 1) * block_m) of local expert e, i.e.
// signal word (e, j) reached the threshold. Relaxed polls at gpu scope (no L1 invalidation per spin),
// then an acquire load pairing with the GEMM's release add; false once the call aborted or the timeout
// passed (recorded for this rank: the signal is its own GEMM's, so nothing is masked).
__device__ __forceinline__ bool wait_computed(const CombineArgs& a, int e, int j) {
  const Comm& c = a.peers.comm;
  const int* word = a.comp_signal + static_cast<size_t>(e) * a.signal_blocks + j;
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(word) : "memory");
  if (v < a.threshold) {
    if (comm_aborted(c)) return false;
    const uint64_t start = global_timer_ns();
    for (uint32_t spin = 1; v < a.threshold; ++spin) {
      asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(word) : "memory");
      if ((spin & 1023u) == 0 && v < a.threshold) {
        if (comm_aborted(c)) return false;
        if (global_timer_ns() - start > c.timeout_ns) {
          report_timeout(c, kPhaseLowLatencyCombineWaitCompute, c.rank);
          return false;
        }
      }
    }
  }
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(word) : "memory");
  return true;  // words only grow: the acquire load sees >= threshold too
}

// Send half for item (local expert e, part p of P) of epoch `epoch`; protocol in the file comment.
// kNetwork: the group spans several nodes (within one node there are no scratch rounds and no
// NVSHMEM calls). kOverlap: wait for the GEMM's signal before reading a row (a.comp_signal set).
template <bool kNetwork, bool kOverlap>
__device__ __forceinline__ void send_rows(const CombineArgs& a, unsigned long long epoch, int e, int p) {
  const Peers& s = a.peers;
  const Comm& c = s.comm;
  const int set = static_cast<int>(epoch & 1);
  const int parts = a.blocks_per_expert;
  const int rows = a.count[e];
  const size_t expert_row0 = static_cast<size_t>(e) * c.nranks * a.max_tokens;
  const int row_int4 = a.hidden / 8;
  const int row_chunks = chunks_of(row_int4);
  const int block_rows = rows > p ? (rows - p + parts - 1) / parts : 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int round_rows = kNetwork ? kScratchRows : max(block_rows, 1);  // one round within a node
  int4* const scratch = a.scratch + static_cast<size_t>(e * parts + p) * kScratchRows * row_int4;  // the item's own
  int acquired = -1;  // kOverlap: the last signal block this thread acquired (its rows ascend)
  for (int r0 = 0; r0 < block_rows; r0 += round_rows) {
    const int n = min(round_rows, block_rows - r0);
    for (int item = warp; item < n * row_chunks; item += warps) {
      const int r = item / row_chunks, chunk = item - r * row_chunks;
      const size_t m = expert_row0 + p + static_cast<size_t>(parts) * (r0 + r);
      const int expert_row = p + parts * (r0 + r);
      int4 v[kChunkUnroll];
      const int j = kOverlap ? expert_row / a.block_m : -1;
      if (j == acquired || wait_computed(a, e, j)) {
        acquired = j;
        warp_load_chunk(v, a.y + m * row_int4, row_int4, chunk, lane);  // issued with the src_* loads below
      } else {
#pragma unroll
        for (int u = 0; u < kChunkUnroll; ++u) v[u] = bf16_nan_x8();  // the row was never computed
      }
      const int dst = a.src_rank[m];
      if (skip_rank(c, dst)) continue;
      int4* row = in_node(s, dst)
                      ? reinterpret_cast<int4*>(node_addr(s, dst, staging_at(a, set, a.src_index[m], a.src_k[m])))
                      : scratch + static_cast<size_t>(r) * row_int4;
      warp_store_chunk(row, v, row_int4, chunk, lane);
    }
    if (!kNetwork) continue;
    __syncthreads();  // the round's scratch rows are complete: they are the source of the puts
    for (int r = warp; r < n; r += warps) {
      const size_t m = expert_row0 + p + static_cast<size_t>(parts) * (r0 + r);
      const int dst = a.src_rank[m];
      if (in_node(s, dst) || skip_rank(c, dst)) continue;
      fence_acq_rel_sys();
      nvshmemx_putmem_nbi_warp(s.sym + staging_at(a, set, a.src_index[m], a.src_k[m]),
                               scratch + static_cast<size_t>(r) * row_int4, 2 * static_cast<size_t>(a.hidden), dst);
    }
    if (r0 + round_rows < block_rows) {  // the next round rewrites the scratch: complete these puts first
      __syncthreads();
      if (threadIdx.x == 0) nvshmem_quiet();
      __syncthreads();
    }
  }
}

// Receive half for token n, int4 columns [col0, col0 + kBlockThreads), after wait_all_sources (ok: it
// succeeded); protocol in the file comment. kSlots >= num_topk: rows held in registers per thread.
template <int kSlots>
__device__ __forceinline__ void reduce_token(const CombineArgs& a, unsigned long long epoch, int n, int col0, bool ok) {
  __shared__ float weight[kMaxTopk];
  __shared__ int slot_k[kMaxTopk];  // staging slot of k (first k with the same expert), -1 if none
  const Comm& c = a.peers.comm;
  const int set = static_cast<int>(epoch & 1);
  const int num_experts = a.num_local_experts * c.nranks;
  const int row_int4 = a.hidden / 8;
  const int i = col0 + threadIdx.x;
  if (!ok) {  // a failed call's result is NaN, never rows that look valid
    if (i < row_int4) reinterpret_cast<int4*>(a.out)[static_cast<size_t>(n) * row_int4 + i] = bf16_nan_x8();
    return;
  }
  __syncthreads();  // the block's previous token no longer reads weight / slot_k
  if (threadIdx.x < kMaxTopk) {
    const int k = threadIdx.x;
    const int64_t* idx = a.stash_idx + static_cast<size_t>(n) * a.num_topk;
    const int id = k < a.num_topk ? checked_expert(c.error, idx[k], num_experts, n, k) : -1;
    int first = -1;
    if (id >= 0 && !skip_rank(c, id / a.num_local_experts)) {  // a masked rank's experts contribute nothing
      first = k;
      for (int q = k - 1; q >= 0; --q)
        if (idx[q] == id) first = q;
    }
    slot_k[k] = first;
    weight[k] = k < a.num_topk ? a.stash_weights[static_cast<size_t>(n) * a.num_topk + k] : 0.0f;
  }
  __syncthreads();
  if (i >= row_int4) return;
  const int4* token_rows = a.payload + (static_cast<size_t>(set) * a.max_tokens + n) * a.num_topk * row_int4;
  int4 v[kSlots];
#pragma unroll
  for (int k = 0; k < kSlots; ++k)
    if (k < a.num_topk && slot_k[k] >= 0) v[k] = token_rows[static_cast<size_t>(slot_k[k]) * row_int4 + i];
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    if (k >= a.num_topk || slot_k[k] < 0) continue;
    const unsigned w[4] = {static_cast<unsigned>(v[k].x), static_cast<unsigned>(v[k].y),
                           static_cast<unsigned>(v[k].z), static_cast<unsigned>(v[k].w)};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float x = __uint_as_float(j & 1 ? (w[j >> 1] & 0xffff0000u) : (w[j >> 1] << 16));
      acc[j] = __fadd_rn(acc[j], __fmul_rn(weight[k], x));
    }
  }
  unsigned packed[4];
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(acc[2 * h], acc[2 * h + 1]);  // .x -> low half
    packed[h] = *reinterpret_cast<const unsigned*>(&b);
  }
  a.out[static_cast<size_t>(n) * row_int4 + i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// Virtual send block b of `grid` (file comment): its items b, b + grid, ..., then its finish_send_block.
template <bool kNetwork, bool kOverlap>
__device__ __forceinline__ void send_block(const CombineArgs& a, unsigned long long epoch, int b, int grid) {
  const int items = a.blocks_per_expert * a.num_local_experts;
  for (int item = b; item < items; item += grid)
    send_rows<kNetwork, kOverlap>(a, epoch, item / a.blocks_per_expert, item % a.blocks_per_expert);
  finish_send_block(a.peers, a.done, grid, kSigCombineNode + static_cast<int>(epoch & 1), kSigCombineNet,
                    kEpochCombine, epoch);
}

}  // namespace

// The combine kernel: the send half and/or the receive half (file comment). kOverlap: at most num_sms
// blocks run the G = a.grid virtual send blocks, and the send half waits for comp_signal; one block
// per SM is enough for them, so they get up to 128 registers (no spills with the waits). Otherwise
// launched block b is virtual block b: a separate instantiation, since a loop over virtual blocks
// costs the plain kernel register spills.
template <bool kNetwork, int kSlots, bool kOverlap>
__global__ void __launch_bounds__(kBlockThreads, kOverlap ? 1 : 2) combine(const CombineArgs a) {
  const Comm& c = a.peers.comm;
  if (block_stamps_disagreed(c)) return;  // the call's stamp exchange found the ranks' calls differ (comm.h)
  // A send (with or without the receive) starts epoch e = epochs[10] + 1; a receive alone follows
  // the send launch of the same call, which published e into epochs[10].
  const unsigned long long epoch = c.epochs[kEpochCombine] + (a.send ? 1 : 0);
  if (a.send) {
    stash_routing(a);
    if constexpr (kOverlap) {
      for (int b = blockIdx.x; b < a.grid; b += gridDim.x) send_block<kNetwork, true>(a, epoch, b, a.grid);
    } else {
      send_block<kNetwork, false>(a, epoch, blockIdx.x, static_cast<int>(gridDim.x));
    }
  }
  if (!a.receive) return;
  // Every block waits, also with N == 0: that wait is a link of the buffer reuse chain above (this
  // rank's next send must follow the other ranks' receives).
  const bool ok = wait_all_sources(a.peers, kSigCombineNode + static_cast<int>(epoch & 1),
                                   arrivals_after(epoch, a.grid), kSigCombineNet, epoch,
                                   kPhaseLowLatencyCombineRecv);
  const int cols = (a.hidden / 8 + kBlockThreads - 1) / kBlockThreads;
  for (int item = blockIdx.x; item < a.num_tokens * cols; item += gridDim.x)
    reduce_token<kSlots>(a, epoch, item / cols, item % cols * kBlockThreads, ok);
}

void launch_combine(const LowLatencyParams& p, const CombineLaunchArgs& call, uintptr_t stream) {
  CombineArgs a{};
  a.peers = make_peers(p);
  a.payload_offset = p.combine_payload_offset;
  a.scratch = reinterpret_cast<int4*>(p.sym + p.combine_scratch_offset);
  a.y = reinterpret_cast<const int4*>(call.y);
  a.src_rank = reinterpret_cast<const int*>(call.src_rank);
  a.src_index = reinterpret_cast<const int*>(call.src_index);
  a.src_k = reinterpret_cast<const int*>(call.src_k);
  a.count = reinterpret_cast<const int*>(call.count);
  a.topk_idx = reinterpret_cast<const int64_t*>(call.topk_idx);
  a.topk_weights = reinterpret_cast<const float*>(call.topk_weights);
  a.stash_idx = reinterpret_cast<int64_t*>(p.combine_stash);
  a.stash_weights = reinterpret_cast<float*>(p.combine_stash + sizeof(int64_t) * p.max_tokens * p.num_topk);
  a.done = reinterpret_cast<int*>(p.done_counters) + 1;
  a.payload = reinterpret_cast<const int4*>(p.sym + p.combine_payload_offset);
  a.out = reinterpret_cast<uint4*>(call.out);
  a.comp_signal = reinterpret_cast<const int*>(call.comp_signal);
  a.block_m = call.block_m;
  a.threshold = call.threshold;
  const bool overlap = call.num_sms > 0;
  a.signal_blocks = overlap ? (p.nranks * p.max_tokens + call.block_m - 1) / call.block_m : 0;
  a.grid = kernel_blocks(p);
  a.num_tokens = call.num_tokens;
  a.num_topk = p.num_topk;
  a.hidden = p.hidden;
  a.max_tokens = p.max_tokens;
  a.num_local_experts = p.num_local_experts;
  a.blocks_per_expert = p.blocks_per_expert;
  a.send = call.send;
  a.receive = call.receive;
  const int blocks = overlap ? std::min(call.num_sms, a.grid) : a.grid;
  const bool wide = p.num_topk > 8;
  void (*kernel)(CombineArgs);
  if (a.peers.network)
    kernel = overlap ? (wide ? combine<true, kMaxTopk, true> : combine<true, 8, true>)
                     : (wide ? combine<true, kMaxTopk, false> : combine<true, 8, false>);
  else
    kernel = overlap ? (wide ? combine<false, kMaxTopk, true> : combine<false, 8, true>)
                     : (wide ? combine<false, kMaxTopk, false> : combine<false, 8, false>);
  launch_cooperative(kernel, blocks, a, stream, "combine kernel launch");
}

}  // namespace ll
}  // namespace moe_ep
