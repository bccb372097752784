// Normal-mode (training / prefill) dispatch and combine across nodes: host-side parameters, the
// symmetric workspace layout (its only owner: Python asks for sizes through the bindings) and the
// kernel launchers. The part under __CUDACC__ holds the device code shared by notify.cu,
// dispatch.cu and combine.cu in this folder.
//
// Topology: R ranks in N_n = R / L nodes of L ranks (L = ranks_per_node, at most kMaxNodeRanks); rank
// (n, l) = n * L + l. The network leg joins ranks of equal local index l in different nodes and uses
// only NVSHMEM device operations (puts, signal ops, nvshmem_fence, signal fetch); the NVLink leg joins
// the ranks of one node through peer addresses (loads and stores, release/acquire at system scope).
//
// Hierarchical path: a token of source (n_s, l) crosses the network once per destination node n_d, to
// the "forwarder" (n_d, l), which stores it over NVLink into every rank of n_d that holds one of its
// experts. Combine mirrors it: ranks store their rows into the forwarder of the token's source, the
// forwarder sums them (float32, ascending local rank, rounded to bf16 once: the node's partial) and
// puts one partial per (token, node) back; the source sums the partials in ascending node order.
// Weights given to a combine travel in the same slots as their rows (after the row) and are summed
// in the same order, in float32 throughout (the node's weight partial is not rounded).
//
// Rounds and channels bound the memory: a call moves tokens in rounds of C token slots (token t of a
// source is slot t % C of round t / C, every rank runs ceil(max N / C) rounds), and each round is cut
// into Q channels of S = ceil(C / Q) consecutive slots, Q being the call's grid (at most
// kMaxChannels; every rank launches the same grid, num_sms). Block q is channel q and only talks to
// block q of other ranks: each channel is an independent pipeline. Every buffer below has two sets,
// used by rounds of alternating parity of a global round counter (the round's "epoch", which numbers
// every round of every call of the Buffer and so never repeats); inside a call a producer reuses a set
// only after the consumer returned a credit for the round that last used it, and a call starts only
// once every rank it exchanges data with finished its previous call (notify, or start_sig), so the
// sets are free at a call's start whatever grid the previous call had. Slots are indexed by the
// token's slot, not packed: a slot holds a row of round e when its RowMeta::tag == e, so no counts
// travel with the rows. A call carries at most T tokens per rank (forward_mask and own_row have T
// columns); a larger exact-size call is streamed above the kernels (moe_ep/comm/backends/engine.py) as
// a sequence of such calls, each after its own notify, with recv_info's first row per source placing
// its rows inside the whole output.
//
// Symmetric workspace of one rank (WorkspaceLayout; uint64 signal words first, all zero at start):
//   rdma_sig        [2][N_n][Q]   network: source node n_s's rows of round e (set e&1) landed (SET e)
//   rdma_credit     [N_n][Q]      network: forwarder in node n_d finished round e of my rows (SET e)
//   nvl_sig         [2][L][Q]     NVLink: forwarder l stored round e into my nvl area
//   nvl_credit      [L][Q]        NVLink: local rank j finished reading my round e
//   comb_nvl_sig    [2][L][Q]     NVLink: local rank j stored its combine rows of round e here
//   comb_nvl_credit [L][Q]        NVLink: forwarder l finished reading my combine rows of round e
//   comb_recv_sig   [2][N_n][Q]   network: node n_d's partials of round e landed (SET e)
//   comb_credit     [N_n][Q]      network: source in node n_s finished reading my partials of round e
//   notify_sig      [R]           network: rank s's counts of call epoch e landed (SET e)
//   start_sig       [2][R]        network: rank s started its combine ([0]) / cached dispatch ([1]) of
//                                 call epoch e, so it finished its previous call (SET e)
//   counts          [2][R][CS]    int32, set = call epoch & 1; row s from rank s: [N_s, rows s sends
//                                 here, then s's token counts for my E_l local experts, then s's call
//                                 stamp (kStampWords, runtime/call_stamp.h)]
//   notify_stage    [R][CS]       int32, my counts for each destination (the put source)
//   send_row        [2][C][RB]    my rows (then FP8 scales), staged as the network put source
//   send_meta       [2][N_n][C]   RowMeta of my token for destination node n_d
//   rdma_row/meta   [2][N_n][C]   forwarder: rows + meta from source node n_s (same local index)
//   nvl_row/meta    [2][L][N_n][C] receiver: rows + meta from forwarder l of source node n_s
//   comb_nvl        [2][L][N_n][C][CB] forwarder: local rank j's combine row for source node n_s's slot
//   comb_stage      [2][N_n][C][CB] forwarder: the node partial, staged as the network put source
//   comb_recv       [2][N_n][C][CB] source: node n_d's partial for my slot
// A combine slot (CB bytes, Dims::comb_stride) is the bf16 row (2H), then K float32 weights (at
// Dims::comb_weights_offset, rounded up to 16 bytes): the row's weights in comb_nvl, their node sum
// in comb_stage and comb_recv. Only a combine with weights writes or reads them (without, the stale
// bytes travel with the row, unread).
#pragma once
#include <cstddef>
#include <cstdint>

#include "runtime/call_stamp.h"
#include "runtime/host_device.h"
#include "runtime/limits.h"

namespace moe_ep {
namespace internode {

constexpr int kMaxGroupRanks = 1024;  // R, at most (runtime/limits.h kMaxNodeRanks bounds a node, not the group)
constexpr int kMaxChannels = 64;  // Q (the grid of a dispatch or combine), at most
// Device int64 counters: [0] notify calls, [1] dispatch rounds, [2] combine rounds, [3] combine calls,
// [4] cached dispatch calls.
constexpr int kEpochCounters = 5;

// What travels with a row on both legs (176 bytes, a multiple of 16).
struct alignas(16) RowMeta {
  uint64_t tag;              // epoch of the round whose row this slot holds
  int32_t src_index;         // token index at the source
  int32_t local_mask;        // bit j: local rank j of the destination node receives the row
  int32_t pos[kMaxNodeRanks];    // the token's position among the source's tokens for local rank j
  int32_t topk[kMaxTopk];    // global expert ids, -1 = none (absent in a cached dispatch)
  float weights[kMaxTopk];
};
static_assert(sizeof(RowMeta) == 176, "RowMeta is 176 bytes");

struct Dims {
  int rank;
  int nranks;          // R
  int local;           // L = ranks per node
  int max_tokens;      // T
  int hidden;          // H
  int num_topk;        // K
  int num_experts;     // E
  int round_tokens;    // C

  MOE_EP_HOST_DEVICE int nodes() const { return nranks / local; }
  MOE_EP_HOST_DEVICE int num_local_experts() const { return num_experts / nranks; }
  MOE_EP_HOST_DEVICE int scale_offset() const { return (2 * hidden + 15) / 16 * 16; }                  // FP8 scales inside a staged row
  MOE_EP_HOST_DEVICE int row_stride() const { return scale_offset() + (hidden / 128 * 4 + 15) / 16 * 16; }  // RB
  MOE_EP_HOST_DEVICE int count_stride() const { return (2 + num_local_experts() + kStampWords + 3) / 4 * 4; }          // CS
  MOE_EP_HOST_DEVICE int comb_weights_offset() const { return 2 * hidden; }  // in a combine slot (16 | 2H)
  MOE_EP_HOST_DEVICE int comb_stride() const { return comb_weights_offset() + (num_topk * 4 + 15) / 16 * 16; }  // CB
};

struct WorkspaceLayout {
  uint64_t rdma_sig, rdma_credit, nvl_sig, nvl_credit, comb_nvl_sig, comb_nvl_credit, comb_recv_sig, comb_credit,
      notify_sig, start_sig;
  uint64_t counts, notify_stage, send_row, send_meta, rdma_row, rdma_meta, nvl_row, nvl_meta, comb_nvl, comb_stage,
      comb_recv;
  uint64_t total;
};

// Byte offsets of every area (see the top of this file); depends on every Dims field.
inline WorkspaceLayout workspace_layout(const Dims& d) {
  const uint64_t R = d.nranks, L = d.local, Nn = d.nodes(), Q = kMaxChannels, C = d.round_tokens;
  const uint64_t RB = d.row_stride(), M = sizeof(RowMeta), CB = d.comb_stride(), CS = d.count_stride();
  WorkspaceLayout w{};
  uint64_t at = 0;
  const auto take = [&](uint64_t bytes) {
    const uint64_t start = at;
    at += (bytes + 255) / 256 * 256;
    return start;
  };
  w.rdma_sig = take(2 * Nn * Q * 8);
  w.rdma_credit = take(Nn * Q * 8);
  w.nvl_sig = take(2 * L * Q * 8);
  w.nvl_credit = take(L * Q * 8);
  w.comb_nvl_sig = take(2 * L * Q * 8);
  w.comb_nvl_credit = take(L * Q * 8);
  w.comb_recv_sig = take(2 * Nn * Q * 8);
  w.comb_credit = take(Nn * Q * 8);
  w.notify_sig = take(R * 8);
  w.start_sig = take(2 * R * 8);
  w.counts = take(2 * R * CS * 4);
  w.notify_stage = take(R * CS * 4);
  w.send_row = take(2 * C * RB);
  w.send_meta = take(2 * Nn * C * M);
  w.rdma_row = take(2 * Nn * C * RB);
  w.rdma_meta = take(2 * Nn * C * M);
  w.nvl_row = take(2 * L * Nn * C * RB);
  w.nvl_meta = take(2 * L * Nn * C * M);
  w.comb_nvl = take(2 * L * Nn * C * CB);
  w.comb_stage = take(2 * Nn * C * CB);
  w.comb_recv = take(2 * Nn * C * CB);
  w.total = at;
  return w;
}

// Largest round C (at most T) whose workspace fits in `budget_bytes`; 1 when even that does not fit
// (the caller reports the size).
inline int choose_round_tokens(Dims d, uint64_t budget_bytes) {
  int lo = 1, hi = d.max_tokens;
  while (lo < hi) {  // the workspace grows with C
    d.round_tokens = (lo + hi + 1) / 2;
    if (workspace_layout(d).total <= budget_bytes) lo = d.round_tokens;
    else hi = d.round_tokens - 1;
  }
  return lo;
}

struct Context {
  Dims dims;
  WorkspaceLayout ws;
  unsigned long long timeout_ns;
  uintptr_t error;                  // ErrorState*, device address of host-mapped memory
  uintptr_t verdict;                // int32, device: the stamp verdict (comm.h)
  uintptr_t epochs;                 // int64[kEpochCounters], device
  uintptr_t block_counters;         // int32[2], zero between kernels ([0] dispatch, [1] combine)
  uintptr_t workspace;              // this rank's workspace (also its symmetric address for puts)
  uintptr_t node_peers[kMaxNodeRanks];  // workspace of local rank j of this node, as addressed here
};

// recv_info, int32: [0, R) rows from each source; [R, 2R) first output row of each source;
// [2R, 2R + E_l) received rows per local expert (not aligned); [2R + E_l] rounds of this call.
inline int recv_info_entries(const Dims& d) { return 2 * d.nranks + d.num_local_experts() + 1; }

struct RouteArgs {
  uintptr_t topk_idx;           // [N, K] int64
  int num_tokens;               // N
  uintptr_t in_rank;            // out [N, R] bool
  uintptr_t pos;                // out [N, R] int32: position among my tokens for rank r, -1 if not sent
  uintptr_t in_node;            // out [N, N_n] bool
  uintptr_t tokens_per_rank;    // out [R] int32
  uintptr_t tokens_per_expert;  // out [E] int32 (a token naming an expert twice counts once)
};

struct NotifyArgs {
  uintptr_t tokens_per_rank;    // [R] int32: my tokens for each rank
  uintptr_t tokens_per_expert;  // [E] int32: my tokens for each expert (once per token)
  int num_tokens;
  uintptr_t recv_info;          // out, device
  uintptr_t tokens_per_expert_aligned;  // out [E_l] int32
  uintptr_t host_info;          // out [R + E_l + R * kStampWords] int32 host-mapped (with every rank's
                                //   stamp), or 0: the context's mailbox, set by InternodeContext.notify
                                //   (not a Python field)
  int expert_alignment;
  bool worst_case;
  int stamp[kStampWords];       // this rank's call stamp (set by InternodeContext.notify, not a Python field)
};

struct DispatchArgs {
  uintptr_t x;                  // [N, row_bytes]
  uintptr_t x_scales;           // [N, num_scales] float32, or 0
  uintptr_t topk_idx;           // [N, K] int64, 0 for a cached dispatch
  uintptr_t topk_weights;       // [N, K] float32, 0 for a cached dispatch
  uintptr_t pos;                // [N, R] int32: position among my tokens for rank r, -1 if not sent
  uintptr_t in_node;            // [N, N_n] bool
  uintptr_t recv_info;
  int num_tokens;
  int row_bytes;                // 2H (bf16) or H (e4m3)
  int num_scales;               // H / 128 for FP8, else 0
  int num_rows;                 // M, rows of the out_ tensors; only the host check reads it
  uintptr_t out_x, out_scales, out_topk_idx, out_topk_weights, out_src_rank, out_src_index;  // [M, row_bytes],
                                // [M, num_scales] float32 or 0, [M, K] int64, [M, K] float32, [M] int32, [M] int32
                                // (the last four 0 for a cached dispatch)
  uintptr_t forward_mask;       // out [N_n, T] int32: as forwarder, local mask of each (source node, token)
  uintptr_t own_row;            // out [N_n, T] int32: as forwarder, my output row of each token I received
                                // from source (n_s, my local index) (0 for a cached dispatch)
  bool worst_case;              // M = R * T, source s at [s * T, s * T + count_s), the rest padding (the kernel
                                // writes it)
  bool cached;
  int num_blocks;
};

struct CombineArgs {
  uintptr_t x;                  // [M, H] bf16, rows received by the dispatch
  uintptr_t src_index;          // [M] int32 (ascending inside each source's rows)
  uintptr_t recv_info;          // of the dispatch
  uintptr_t forward_mask;       // [N_n, T] int32 of the dispatch
  uintptr_t own_row;            // [N_n, T] int32 of the dispatch
  uintptr_t in_node;            // [N, N_n] bool of the dispatch
  int num_tokens;               // N
  int num_rows;                 // M, rows of x and src_index; only the host check reads it
  uintptr_t out;                // [N, H] bf16
  bool with_weights;            // the call has weights: topk_weights travel with the rows, their sums
  uintptr_t topk_weights;       //   go to out_topk_weights (a pointer may be 0 when its tensor is empty)
  uintptr_t out_topk_weights;   // [M, K] and [N, K] float32
  int num_blocks;
};

// The launchers. InternodeContext (bindings.cpp in this folder) checks every argument struct first
// (check(dims, args): a pointer the call's sizes say it uses must not be 0, a size must fit the Dims).
void launch_route(const Context& c, const RouteArgs& a, uintptr_t stream);
void launch_notify(const Context& c, const NotifyArgs& a, uintptr_t stream);
void launch_dispatch(const Context& c, const DispatchArgs& a, uintptr_t stream);
void launch_combine(const Context& c, const CombineArgs& a, uintptr_t stream);

}  // namespace internode
}  // namespace moe_ep

#if defined(__CUDACC__)
#include <cuda_runtime.h>

#include "kernels/common/warp_copy.cuh"
#include "runtime/comm.h"

namespace moe_ep {
namespace internode {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kCopyUnroll = 4;

// What every kernel of this folder receives (by value, as a __grid_constant__ parameter).
struct DeviceContext {
  Comm comm;  // comm.signals is unused here: the signal words live in the workspace
  Dims dims;
  WorkspaceLayout ws;
  char* workspace;
  char* node_peers[kMaxNodeRanks];
  int* block_counters;

  __device__ __forceinline__ int nodes() const { return dims.nranks / dims.local; }
  __device__ __forceinline__ int node() const { return comm.rank / dims.local; }
  __device__ __forceinline__ int local() const { return comm.rank % dims.local; }
  // An area of this rank's workspace (for the network leg also the remote address of the same area).
  template <class T>
  __device__ __forceinline__ T* at(uint64_t offset) const { return reinterpret_cast<T*>(workspace + offset); }
  // The same area at local rank j of this node (NVLink).
  template <class T>
  __device__ __forceinline__ T* at_peer(int j, uint64_t offset) const {
    return reinterpret_cast<T*>(node_peers[j] + offset);
  }
  __device__ __forceinline__ uint64_t* word(uint64_t offset, size_t index) const { return at<uint64_t>(offset) + index; }
  __device__ __forceinline__ uint64_t* peer_word(int j, uint64_t offset, size_t index) const {
    return at_peer<uint64_t>(j, offset) + index;
  }
};

inline DeviceContext make_device_context(const Context& c) {
  DeviceContext d{};
  d.comm.rank = c.dims.rank;
  d.comm.nranks = c.dims.nranks;
  d.comm.timeout_ns = c.timeout_ns;
  d.comm.error = reinterpret_cast<ErrorState*>(c.error);
  d.comm.verdict = reinterpret_cast<const int*>(c.verdict);
  d.comm.epochs = reinterpret_cast<unsigned long long*>(c.epochs);
  d.dims = c.dims;
  d.ws = c.ws;
  d.workspace = reinterpret_cast<char*>(c.workspace);
  for (int j = 0; j < kMaxNodeRanks; ++j) d.node_peers[j] = reinterpret_cast<char*>(c.node_peers[j]);
  d.block_counters = reinterpret_cast<int*>(c.block_counters);
  return d;
}


// Threads of the block wait, one word each, until words[i * stride] >= target for i < count
// (network words through wait_signal_geq, NVLink words through wait_geq); then the block joins, and
// returns false in every thread when a wait gave up. `peer_of(i)` names the rank a word waits for.
template <bool kNetwork, class PeerOf>
__device__ __forceinline__ bool block_wait(const Comm& c, uint64_t* words, int count, int stride, uint64_t target,
                                           int phase, PeerOf peer_of) {
  bool ok = true;
  for (int i = threadIdx.x; ok && i < count; i += blockDim.x) {
    uint64_t* w = words + (size_t)i * stride;
    ok = kNetwork ? wait_signal_geq(c, w, target, phase, peer_of(i)) : wait_geq(c, w, target, phase, peer_of(i));
  }
  return __syncthreads_and(ok) != 0;
}

// Start barrier of a call that has no notify (combine: kind 0, cached dispatch: kind 1). Block 0 sets
// start_sig[kind][me] = epoch (nvshmemx_signal_op) at every rank it exchanges data with (the same
// local index in every node, and every rank of its node); every block then waits for theirs. A rank
// does this only once its stream finished its previous call, so afterwards no peer still reads or
// writes a buffer that this call uses, whatever grid the previous call had.
__device__ __forceinline__ bool start_barrier(const DeviceContext& ctx, int kind, uint64_t epoch) {
  const int L = ctx.dims.local, Nn = ctx.nodes(), n = ctx.node(), l = ctx.local();
  uint64_t* words = ctx.word(ctx.ws.start_sig, (size_t)kind * ctx.comm.nranks);
  const auto peer = [&](int i) { return i < Nn ? i * L + l : n * L + i - Nn; };
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < Nn + L; i += blockDim.x)
      nvshmemx_signal_op(words + ctx.comm.rank, epoch, NVSHMEM_SIGNAL_SET, peer(i));
  bool ok = true;
  for (int i = threadIdx.x; ok && i < Nn + L; i += blockDim.x)
    ok = wait_signal_geq(ctx.comm, words + peer(i), epoch, kPhaseNodeStart, peer(i));
  return __syncthreads_and(ok) != 0;
}

// This block's channel of the call: slots [first, first + width) of every round.
struct Channel {
  int first;
  int width;
};

__device__ __forceinline__ Channel my_channel(int round_tokens) {
  const int S = (round_tokens + gridDim.x - 1) / gridDim.x, first = blockIdx.x * S;
  return Channel{first, max(0, min(S, round_tokens - first))};
}

// dst at local rank j (offset `dst_offset` of its workspace) = src, `vecs` int4, for every j in
// `mask`, by one warp: each chunk of kCopyUnroll int4 per lane is loaded once (through L2: another
// GPU or the NIC wrote it) and stored to every destination.
__device__ __forceinline__ void warp_copy_to_peers(const DeviceContext& ctx, uint64_t dst_offset, const int4* src,
                                                   int vecs, unsigned mask, int lane) {
  warp_copy<kCopyUnroll>(src, vecs, lane, LoadCg{}, mask,
                         [&](int j) { return ctx.at_peer<int4>(j, dst_offset); });
}

// Threads j < count of the block publish `value` into word `index` of area `offset` at local rank j:
// the block's earlier stores (and loads) are ordered before it by the caller's __syncthreads and a
// fence.acq_rel.sys (cumulative), then a relaxed system-scope store (comm.h release pattern).
__device__ __forceinline__ void publish_to_node(const DeviceContext& ctx, uint64_t offset, size_t index, int count,
                                                uint64_t value) {
  for (int j = threadIdx.x; j < count; j += blockDim.x) {
    fence_acq_rel_sys();
    st_relaxed_sys(ctx.peer_word(j, offset, index), value);
  }
}

// Network puts of one chunk, spread over warps [first_warp, first_warp + warps) of the block (every
// warp by default): item (p, i) for p < peers and i < S (the channel's width) puts slot k0 + i (`stride` bytes at src(p) + k * stride) to dst + k * stride at PE pe(p) when
// present(p, i) holds (nvshmemx_putmem_nbi_warp; one row per warp at a time keeps every warp of the
// block moving bytes). The caller makes the block join and fences before it signals.
template <class Src, class Pe, class Present>
__device__ __forceinline__ void put_chunk(char* dst, Src src, size_t stride, int peers, int k0, int S, Pe pe,
                                          Present present, int warp = threadIdx.x / 32,
                                          int warps = blockDim.x / 32) {
  for (int item = warp; item < peers * S; item += warps) {
    const int p = item / S, k = k0 + item % S;
    if (!present(p, item % S)) continue;
    nvshmemx_putmem_nbi_warp(dst + (size_t)k * stride, src(p) + (size_t)k * stride, stride, pe(p));
  }
}

}  // namespace internode
}  // namespace moe_ep
#endif  // __CUDACC__
