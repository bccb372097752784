// Low-latency dispatch: every token travels once to each rank that holds at least one of its
// experts, into that rank's symmetric staging (NVLink stores for ranks of this node, NVSHMEM puts
// for ranks of other nodes), and the receiver expands the staged tokens into expert-major rows
// [E_l, R*T, H] packed by (source rank, source token). Rows travel as bf16, FP8 (e4m3 with a float32
// scale per 128 channels) or NVFP4 (e2m1 pairs with an e4m3 scale per 16 channels, low_latency.h), each
// format its own instantiation dispatch<RowFormat, round_scale>, cast by the sending rank.
//
// Protocol: one kernel, `dispatch`, with a send half and a receive half. A call without the receive
// hook is one launch running both halves; with the hook it is a launch running the send half, then
// (in hook()) a launch running the receive half, same stream. "Node ranks" are the ranks of this
// rank's node (ranks_per_node), "net ranks" all others; nothing below depends on whether nvshmem_ptr
// reaches a net rank. Grid: G = kernel_blocks (low_latency.h: P * E_l blocks of 512 threads, at most
// two per SM, launched cooperatively so all are resident; the same G on every rank and for both
// launches, so receivers know how many arrivals to wait for). A launch with the send half reads the
// call's epoch e = epochs[8] + 1 in every block before the block arrives (below); a receive-only
// launch reads e = epochs[8], which the send launch published.
//
// Send half — block b takes tokens b, b + G, ... One thread per 16 channels (FP8, NVFP4) or 8 channels
// (bf16) of a step; a row takes ceil(H / (512 * 16 or 8)) steps. Every block uses staging set e & 1. Token
// t's staging slot at every rank is [set][me][t] (meta row and payload row). With NVFP4 every thread of
// every block first reads g = x_global_scale[0] (device memory the caller wrote earlier in the stream, so
// a CUDA graph replay reads the value of that replay; read even by a block without tokens: the launch
// check asks for the pointer) and takes 1/g once (__frcp_rn).
//   1. Per token: every thread first issues the loads of its channels of x (step 2), so their latency
//      overlaps the routing. Warp 0 derives it: lane k < K reads topk id k (one coalesced load),
//      computes its rank (32-bit division), and the distinct destination ranks other than me
//      (__match_any_sync) go to shared memory as two lists (slot by token iteration parity): node
//      ranks (as the address of the token's payload slot there) and net ranks. The meta row (global
//      expert id per k as int16, -1 past K; tag = low 32 bits of e) is built by shuffles and stored
//      to the own slot and, by the lane of each node destination, to its slot there. A block barrier
//      publishes the lists.
//   2. FP8: each thread holds 16 channels (two int4), the 8 threads of a 128-channel block reduce
//      amax by shuffles, and each rank quantises its own token exactly once; bf16: one int4 per
//      thread. The 16-byte chunk (and the block scale) is stored to the own slot (always: it is the
//      source of the puts below, and the own receiver skips a token naming none of its experts) and
//      to the slot of each node destination through its NVLink address. NVFP4: each thread holds one
//      16-channel block (two int4) and casts it alone (nvfp4.cuh, no shuffles); block i's 8 value
//      bytes go to payload bytes [8i, 8i + 8) and its scale byte to byte H/2 + i, in the own slot and
//      at each node destination as above.
//   3. Net destinations (only when the group spans several nodes): a block barrier ends the own
//      slot's stores; warp j takes net destinations j, j + warps, ...: one fence.acq_rel.sys (the
//      barrier's stores are performed at system scope before the transport reads them), then
//      nvshmemx_putmem_nbi_warp of the meta row (48 bytes) and of the payload (2H bytes bf16,
//      H + H/32 with FP8, H/2 + H/16 with NVFP4) from the own slot (symmetric memory, registered for
//      every transport) to the same slot at that rank. No completion is awaited here.
//   4. finish_send_block (low_latency.h): the block joins; thread 0 calls nvshmem_quiet() (several
//      nodes: the block's puts are complete at their targets), issues one fence.acq_rel.sys
//      (cumulative over the block's NVLink stores) and adds 1 (relaxed) to node signal
//      [e & 1][me] at every node rank. No block waits for another in this half; the last block to
//      finish (local counter) writes epochs[8] = e for a later receive-only launch and, with
//      several nodes, sets net signal [me] = e at every net rank with nvshmemx_signal_op (issued
//      after every block's quiet, so after all of this call's puts completed: NVSHMEM's quiet
//      guarantee, not put ordering).
// Receive half — items (local expert e, part p) for p < P = 256 / E_l (1 to 32, from the Buffer's
// dimensions), so skewed experts get more warps; block b serves items b, b + G, ... (one each when
// G = P * E_l).
//   1. wait_all_sources, once per block (low_latency.h; timeout -> ErrorState naming rank, peer and
//      phase LowLatencyDispatchRecv; the block then writes count[e] = 0 for its items, p == 0):
//      thread i waits for sources i, i + 512, ...: a node source until its block counter in node
//      signal [e & 1][r] reaches G * ((e + 1) / 2) (all G blocks of every epoch of this parity up
//      to e; relaxed polls, then an acquire load), a net source until net signal [r] >= e
//      (nvshmem_signal_fetch polls, then an acquire fence); a barrier hands the data to the block.
//   2. Scans every staged meta row (s, t) in (s, t) order, contiguous chunks per thread: a row
//      whose tag is not e is stale (its source did not send token t here this call), else the
//      token counts for e once, at its first k naming global expert me * E_l + e. A block-wide
//      exclusive scan of the per-thread counts (common/scan.cuh) gives each token's row:
//      deterministic, no atomics.
//      Rows m with m % P == p are this block's: it writes src_rank / src_index / src_k (first k
//      naming e, for combine) for them, and keeps the staged token of its first 1024 rows in shared
//      memory; item p == 0 writes count[e]. All P items of e compute the same scan. NVFP4: item
//      p == 0 also zeroes expert e's scale tile words of the rows R*T .. rm * 128 - 1 (the last row
//      tile's padding; no token's row, so no other item writes them).
//   3. After a barrier, the block's rows are cut into 4 KB chunks (2 KB with NVFP4) (plus, with FP8
//      or NVFP4, one item for the row's scales), and the (row, chunk) items are spread over all
//      warps: a warp loads its chunk from the local staging (8 int4 per lane, all in flight; NVFP4:
//      8 int2, as H/2 bytes need only be a multiple of 8) and stores it into recv_x[e][m], so each
//      item costs about one round trip whatever the rows per block. Scales are stored in DeepEP's
//      layout, token-major per expert: float32 scale i of row m at recv_scales[e][i][m] (the
//      [E_l, R*T, H/128] result is that [E_l, H/128, R*T] array transposed); with ue8m0 the
//      exponent byte (bits 23..30) of scale i is byte i % 4 of int32 [e][i / 4][m] of a
//      [E_l, H/512, R*T] array (round_scale made every scale a power of two: exact). NVFP4: lane q
//      moves row m's scales 4q .. 4q + 3 as one 4-byte word (those past H/16 zeroed: the padding) to
//      expert e's tiles at nvfp4_scale_offset(rk, m, 4q) (low_latency.h). Rows in [count[e], R*T)
//      are left as they were, in every format.
//
// Why the staging of a set is never overwritten while a receiver still reads it: rank s writes set
// (e & 1) at rank d during its send of epoch e. d last read that set in its receive of epoch e - 2.
// d's receive of e - 2 precedes (stream order) d's send of e - 1, whose completion rank s waits for
// in its receive of e - 1 (block counters or the net signal), which precedes s's send of e. Every
// receive waits for every source, even ranks that sent it no tokens, so the chain exists for every
// pair (s, d). The same chain keeps the node block counter of parity e & 1 free of epoch e + 2's
// adds until d's receive of e has read it; a net signal only grows, so seeing a later epoch there
// also means e's puts completed. s's own slot, the source of its puts, is rewritten only by its
// send of e + 2, after its own receive of e and the quiet of its send of e. A stale meta row of the
// set carries a tag of epoch e - 2 or earlier (or 0, the region starts zeroed), never e. It needs
// each rank to run a call's receive half before the next dispatch's send half: the engine enforces
// that hook() is called before the next low_latency_dispatch. Within a launch running both halves,
// a block's receive half waits for the send half of every block of every rank, this rank's blocks
// included; that cannot deadlock because all G blocks are resident at once (cooperative launch).
//
// FP8 arithmetic matches moe_ep.fp8.quantize bit for bit: amax over 128 channels in float32 (exact),
// clamped to >= 1e-4; scale = amax / 448 by IEEE division (__fdiv_rn), or with round_scale the
// smallest power of two >= that quotient (exponent bump when the mantissa is non-zero, which equals
// frexp's answer); values x / scale by __fdiv_rn, converted to e4m3 round-to-nearest-even with
// saturation to finite (|x| <= amax makes |x / scale| at most a few ulps above 448, far below 464
// where torch's conversion would give NaN, so both round to the same finite value). Both divisions
// are true IEEE divisions: on CUDA, torch turns `tensor / python_float` into a multiply by the
// rounded reciprocal, so the reference must divide by a tensor to match (moe_ep/comm/fp8.py).
//
// NVFP4 arithmetic matches moe_ep.comm.nvfp4.quantize bit for bit for every input and every g (NaN, inf,
// -0, values that round to 0, all-zero blocks, scales saturating at 448, g not finite and positive): the
// recipe of nvfp4.cuh, float32 with __fmul_rn / __frcp_rn (no FMA contraction, no approximate
// reciprocal), amax by fmaxf (PTX max.f32 ignores every NaN operand), e4m3 by cuda_fp8.h's satfinite
// conversion with a NaN scale stored as 0x7F, e2m1 by e2m1_code. tests/test_nvfp4.py runs the same
// source on the host against a float64 oracle over every bf16 bit pattern.
//
// The output rows (recv_x, scales, src_*, count) are ordinary device memory in two sets that the
// host alternates per call (a CUDA graph replays into the set it captured); only the staging and
// the signals follow the device epoch's parity.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "kernels/common/scan.cuh"
#include "kernels/low_latency/low_latency.h"
#include "kernels/low_latency/nvfp4.cuh"

namespace moe_ep {
namespace ll {
// What a dispatch moves: bf16 rows, FP8 rows (e4m3, float32 or UE8M0 scales per 128 channels) or NVFP4
// rows (e2m1 pairs, e4m3 scales per 16 channels); each its own kernel instantiation.
enum class RowFormat { kBf16, kFp8, kNvfp4 };

// The kernel's argument (outside the anonymous namespace, like the kernel, so that profilers show
// the kernel as moe_ep::ll::dispatch<...>).
struct DispatchArgs {
  Peers peers;
  // send half
  uint64_t payload_offset;  // dispatch payload area (set 0) in every rank's region
  uint64_t meta_offset;     // dispatch meta area (set 0)
  const uint4* x;           // [N, H] bf16
  const int64_t* topk_idx;  // [N, K]
  int num_tokens;
  int* done;
  const float* global_scale;  // NVFP4: g, the first element
  // receive half
  const uint8_t* payload;  // this rank's dispatch payload area
  const uint8_t* meta;     // this rank's dispatch meta area
  uint8_t* recv_x;
  float* recv_scales;  // FP8 scales (float32, or UE8M0 bytes), or NVFP4's e4m3 scale tiles
  int* src_rank;
  int* src_index;
  int* src_k;
  int* count;
  int num_local_experts;
  int num_topk;
  int hidden;
  int max_tokens;
  int blocks_per_expert;  // P
  bool ue8m0;             // scales as UE8M0 exponent bytes, four per int32 (file comment, receive step 3)
  bool send;              // run the send half
  bool receive;           // run the receive half
};

namespace {

constexpr int kSharedRows = 1024;  // block rows whose staged token stays in shared memory (others: src_*)

__device__ __forceinline__ float round_up_pow2(float s) {
  const unsigned bits = __float_as_uint(s);
  return (bits & 0x7fffffu) == 0 ? s : __uint_as_float((bits & 0x7f800000u) + 0x800000u);
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float* f) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Quantise 16 floats by `scale` into 16 e4m3 bytes (element j at byte j).
__device__ __forceinline__ uint4 quantize16(const float* v, float scale) {
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
        make_float2(__fdiv_rn(v[4 * i], scale), __fdiv_rn(v[4 * i + 1], scale)), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(__fdiv_rn(v[4 * i + 2], scale), __fdiv_rn(v[4 * i + 3], scale)), __NV_SATFINITE, __NV_E4M3);
    w[i] = static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void store_meta(uint8_t* row, const unsigned (&w)[kMaxTopk / 2], unsigned tag) {
  uint4* dst = reinterpret_cast<uint4*>(row);
  dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
  dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  dst[2] = make_uint4(tag, 0u, 0u, 0u);
}

// Send half of epoch `epoch`; protocol in the file comment (send half).
template <RowFormat kRows, bool kRoundScale>
__device__ __forceinline__ void send_tokens(const DispatchArgs& a, unsigned long long epoch) {
  // Destinations of the current token other than me, by token iteration parity (no barrier needed
  // before reuse): node ranks as their payload slot's address, net ranks as rank numbers.
  __shared__ uint8_t* node_rows[2][kMaxTopk];
  __shared__ int net_ranks[2][kMaxTopk];
  __shared__ int num_node[2], num_net[2];
  const Peers& s = a.peers;
  const Comm& c = s.comm;
  const int set = static_cast<int>(epoch & 1);
  constexpr bool kFp8 = kRows == RowFormat::kFp8, kNvfp4 = kRows == RowFormat::kNvfp4;
  static_assert(kNvfp4Block == 16, "an NVFP4 thread casts the 16 channels of its two uint4 loads");
  constexpr int kChannels = kRows == RowFormat::kBf16 ? 8 : 16;  // channels per thread and step
  constexpr int kVecs = kChannels / 8;                            // uint4 loads per thread and step
  const int chunks = a.hidden / kChannels;
  const size_t row_bytes = 2 * static_cast<size_t>(a.hidden);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float g = 0.0f, inv_g = 0.0f;  // NVFP4's global scale and its correctly rounded reciprocal
  if constexpr (kNvfp4) {
    g = *a.global_scale;
    inv_g = rcp_rn(g);
  }
  int it = 0;
  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x, ++it) {  // block-uniform (barrier, shuffles)
    const int par = it & 1;
    const uint4* src = a.x + static_cast<size_t>(t) * (a.hidden / 8);
    uint4 first[kVecs];  // this thread's first step, loaded before the routing so both latencies overlap
#pragma unroll
    for (int u = 0; u < kVecs; ++u)
      first[u] = static_cast<int>(threadIdx.x) < chunks ? src[kVecs * threadIdx.x + u] : make_uint4(0, 0, 0, 0);
    const size_t slot = static_cast<size_t>(set * c.nranks + c.rank) * a.max_tokens + t;
    const size_t payload_at = a.payload_offset + slot * row_bytes;
    const size_t meta_at = a.meta_offset + slot * kMetaBytes;
    if (warp == 0) {  // lane k owns topk id k
      const int e = lane < a.num_topk ? checked_expert(c.error, a.topk_idx[static_cast<size_t>(t) * a.num_topk + lane],
                                                       a.num_local_experts * c.nranks, t, lane)
                                      : -1;
      const int dst = e >= 0 && !skip_rank(c, e / a.num_local_experts) ? e / a.num_local_experts : -1;
      const unsigned same = __match_any_sync(0xffffffffu, dst);
      const bool first_of_rank = dst >= 0 && dst != c.rank && __ffs(same) - 1 == lane;
      const bool node = first_of_rank && in_node(s, dst);
      const unsigned node_mask = __ballot_sync(0xffffffffu, node);
      const unsigned net_mask = __ballot_sync(0xffffffffu, first_of_rank && !node);
      const unsigned below = (1u << lane) - 1u;
      unsigned w[kMaxTopk / 2];
#pragma unroll
      for (int i = 0; i < kMaxTopk / 2; ++i) {
        const unsigned lo = static_cast<unsigned>(__shfl_sync(0xffffffffu, e, 2 * i)) & 0xffffu;
        const unsigned hi = static_cast<unsigned>(__shfl_sync(0xffffffffu, e, 2 * i + 1)) & 0xffffu;
        w[i] = lo | (hi << 16);
      }
      const unsigned tag = static_cast<unsigned>(epoch);
      if (lane == 0) {
        store_meta(s.sym + meta_at, w, tag);
        num_node[par] = __popc(node_mask);
        num_net[par] = __popc(net_mask);
      }
      if (node) {
        store_meta(node_addr(s, dst, meta_at), w, tag);
        node_rows[par][__popc(node_mask & below)] = node_addr(s, dst, payload_at);
      } else if (first_of_rank) {
        net_ranks[par][__popc(net_mask & below)] = dst;
      }
    }
    __syncthreads();
    const int nodes = num_node[par];
    uint8_t* const own_row = s.sym + payload_at;
    for (int base = 0; base < chunks; base += blockDim.x) {  // block-uniform trip count (shuffles)
      const int i = base + threadIdx.x;
      const bool active = i < chunks;  // FP8: chunks % 8 == 0, a 128-channel block is all in or all out
      uint4 v[kVecs];
#pragma unroll
      for (int u = 0; u < kVecs; ++u) v[u] = base == 0 ? first[u] : (active ? src[kVecs * i + u] : make_uint4(0, 0, 0, 0));
      if constexpr (kFp8) {
        float f[16];
        bf16x8_to_float(v[0], f);
        bf16x8_to_float(v[1], f + 8);
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(f[j]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
        float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
        if constexpr (kRoundScale) scale = round_up_pow2(scale);
        if (!active) continue;
        const uint4 q = quantize16(f, scale);
        for (int d = -1; d < nodes; ++d) {  // -1: the own slot
          uint8_t* row = d < 0 ? own_row : node_rows[par][d];
          reinterpret_cast<uint4*>(row)[i] = q;
          if ((i & 7) == 0) reinterpret_cast<float*>(row + a.hidden)[i >> 3] = scale;
        }
      } else if constexpr (kNvfp4) {
        if (!active) continue;
        float f[kNvfp4Block];
        bf16x8_to_float(v[0], f);
        bf16x8_to_float(v[1], f + 8);
        const Nvfp4Block q = nvfp4_cast(f, g, inv_g);
        for (int d = -1; d < nodes; ++d) {  // -1: the own slot
          uint8_t* row = d < 0 ? own_row : node_rows[par][d];
          reinterpret_cast<uint2*>(row)[i] = q.values;
          row[a.hidden / 2 + i] = q.scale;
        }
      } else {
        if (!active) continue;
        for (int d = -1; d < nodes; ++d) reinterpret_cast<uint4*>(d < 0 ? own_row : node_rows[par][d])[i] = v[0];
      }
    }
    if (!s.network) continue;
    const int nets = num_net[par];
    if (nets == 0) continue;
    __syncthreads();  // the own slot is complete: it is the source of the puts
    const size_t payload_bytes = kFp8     ? a.hidden + static_cast<size_t>(a.hidden / 128) * sizeof(float)
                                 : kNvfp4 ? static_cast<size_t>(a.hidden / 2 + a.hidden / kNvfp4Block)
                                          : row_bytes;
    for (int j = warp; j < nets; j += warps) {
      const int d = net_ranks[par][j];
      fence_acq_rel_sys();
      nvshmemx_putmem_nbi_warp(s.sym + meta_at, s.sym + meta_at, kMetaBytes, d);
      nvshmemx_putmem_nbi_warp(own_row, own_row, payload_bytes, d);
    }
  }
  finish_send_block(s, a.done, static_cast<int>(gridDim.x), kSigDispatchNode + set, kSigDispatchNet, kEpochDispatch,
                    epoch);
}

// First k at which staged token j = s * T + t names local expert e (global expert `expert`), or -1
// (also when the row is stale: its tag is not this call's).
__device__ __forceinline__ int first_k(const DispatchArgs& a, int set, unsigned tag, int j, int expert) {
  if (skip_rank(a.peers.comm, j / a.max_tokens)) return -1;
  const uint4* m = reinterpret_cast<const uint4*>(
      a.meta + (static_cast<size_t>(set * a.peers.comm.nranks) * a.max_tokens + j) * kMetaBytes);
  if (m[2].x != tag) return -1;
  const uint4 q0 = m[0];
  const uint4 q1 = a.num_topk > 8 ? m[1] : make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
  const unsigned w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) {
    const int id = static_cast<int16_t>(w[k >> 1] >> (16 * (k & 1)));
    if (k < a.num_topk && id == expert) return k;
  }
  return -1;
}

// Receive half for local expert e, part p of P, after wait_all_sources; protocol in the file comment.
template <RowFormat kRows>
__device__ __forceinline__ void receive_expert(const DispatchArgs& a, unsigned long long epoch, int e, int p) {
  __shared__ int warp_sums[32];
  __shared__ int staged_j[kSharedRows];  // staged token (s * T + t) of the block's first rows
  const Comm& c = a.peers.comm;
  const int set = static_cast<int>(epoch & 1);
  const int parts = a.blocks_per_expert;
  const int expert = c.rank * a.num_local_experts + e;
  const unsigned tag = static_cast<unsigned>(epoch);
  const int capacity = c.nranks * a.max_tokens;
  const int per_thread = (capacity + blockDim.x - 1) / blockDim.x;
  const int j0 = min(static_cast<int>(threadIdx.x) * per_thread, capacity);
  const int j1 = min(j0 + per_thread, capacity);
  int mine = 0;
  for (int j = j0; j < j1; ++j) mine += first_k(a, set, tag, j, expert) >= 0;
  int total;
  int m = block_exclusive_scan(mine, warp_sums, &total);
  const size_t expert_row0 = static_cast<size_t>(e) * capacity;
  for (int j = j0; j < j1; ++j) {
    const int k = first_k(a, set, tag, j, expert);
    if (k < 0) continue;
    if (m % parts == p) {
      const int s = j / a.max_tokens;
      a.src_rank[expert_row0 + m] = s;
      a.src_index[expert_row0 + m] = j - s * a.max_tokens;
      a.src_k[expert_row0 + m] = k;
      if (m / parts < kSharedRows) staged_j[m / parts] = j;
    }
    ++m;
  }
  if (p == 0 && threadIdx.x == 0) a.count[e] = total;
  constexpr bool kFp8 = kRows == RowFormat::kFp8, kNvfp4 = kRows == RowFormat::kNvfp4;
  Nvfp4Tiles tiles{};  // NVFP4: expert e's scale tiles, at nvfp4_scales
  uint8_t* nvfp4_scales = nullptr;
  if constexpr (kNvfp4) {
    static_assert(kNvfp4TileScales == sizeof(unsigned), "a tile row's scales move as one 4-byte word");
    tiles = nvfp4_tiles(capacity, a.hidden);
    nvfp4_scales = reinterpret_cast<uint8_t*>(a.recv_scales) +
                   static_cast<size_t>(e) * tiles.rows * tiles.scales * kNvfp4TileBytes;
    if (p == 0)  // the last row tile's rows past R*T: padding, zero
      for (int i = threadIdx.x; i < (tiles.rows * kNvfp4TileRows - capacity) * tiles.scales; i += blockDim.x)
        *reinterpret_cast<unsigned*>(nvfp4_scales + nvfp4_scale_offset(tiles.scales, capacity + i / tiles.scales,
                                                                       kNvfp4TileScales * (i % tiles.scales))) = 0u;
  }
  __syncthreads();

  // Copy items: (block row, chunk) pairs spread over all warps, one round trip each; with FP8 or
  // NVFP4 one more item per row moves its scales. A row moves in int4 units, an NVFP4 row (H/2 bytes,
  // a multiple of 8) in int2 units.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const size_t staged_bytes = 2 * static_cast<size_t>(a.hidden);
  const int row_units = kNvfp4 ? a.hidden / 16 : kFp8 ? a.hidden / 16 : a.hidden / 8;
  const int row_chunks = chunks_of(row_units);
  const int items_per_row = row_chunks + (kRows == RowFormat::kBf16 ? 0 : 1);
  const int block_rows = total > p ? (total - p + parts - 1) / parts : 0;
  for (int item = warp; item < block_rows * items_per_row; item += warps) {
    const int r = item / items_per_row, chunk = item - r * items_per_row;
    const size_t row = expert_row0 + p + static_cast<size_t>(parts) * r;
    const int j = r < kSharedRows ? staged_j[r] : a.src_rank[row] * a.max_tokens + a.src_index[row];
    const uint8_t* staged = a.payload + (static_cast<size_t>(set * c.nranks) * a.max_tokens + j) * staged_bytes;
    const size_t m = p + static_cast<size_t>(parts) * r;  // the row inside expert e
    if (chunk < row_chunks && kNvfp4) {
      int2 v[kChunkUnroll];
      warp_load_chunk(v, reinterpret_cast<const int2*>(staged), row_units, chunk, lane);
      warp_store_chunk(reinterpret_cast<int2*>(a.recv_x) + row * row_units, v, row_units, chunk, lane);
    } else if (chunk < row_chunks) {
      int4 v[kChunkUnroll];
      warp_load_chunk(v, reinterpret_cast<const int4*>(staged), row_units, chunk, lane);
      warp_store_chunk(reinterpret_cast<int4*>(a.recv_x + row * row_units * 16), v, row_units, chunk, lane);
    } else if constexpr (kNvfp4) {
      // scales 4q..4q+3 of row m as one word into their tile; those past H/16 zero (the staged row's
      // bytes there are not its scales)
      const int scales = a.hidden / kNvfp4Block;
      const uint8_t* staged_scales = staged + a.hidden / 2;
      for (int q = lane; q < tiles.scales; q += 32) {
        unsigned w = *reinterpret_cast<const unsigned*>(staged_scales + kNvfp4TileScales * q);
        const int past = kNvfp4TileScales * (q + 1) - scales;
        if (past > 0) w &= 0xffffffffu >> (8 * past);
        *reinterpret_cast<unsigned*>(nvfp4_scales + nvfp4_scale_offset(tiles.scales, static_cast<int>(m),
                                                                       kNvfp4TileScales * q)) = w;
      }
    } else {
      const int scales = a.hidden / 128;
      const float* staged_scales = reinterpret_cast<const float*>(staged + a.hidden);
      const size_t expert0 = static_cast<size_t>(e) * scales * capacity;  // elements (float) or bytes (ue8m0)
      if (a.ue8m0) {
        uint8_t* out = reinterpret_cast<uint8_t*>(a.recv_scales) + expert0;
        for (int i = lane; i < scales; i += 32)
          out[(static_cast<size_t>(i >> 2) * capacity + m) * 4 + (i & 3)] =
              static_cast<uint8_t>(__float_as_uint(staged_scales[i]) >> 23);
      } else {
        float* out = a.recv_scales + expert0 + m;
        for (int i = lane; i < scales; i += 32) out[static_cast<size_t>(i) * capacity] = staged_scales[i];
      }
    }
  }
  __syncthreads();  // staged_j and warp_sums are free for the block's next item
}

}  // namespace

// The dispatch kernel: the send half and/or the receive half (file comment).
template <RowFormat kRows, bool kRoundScale>
__global__ void __launch_bounds__(kBlockThreads, 2) dispatch(const DispatchArgs a) {
  const Comm& c = a.peers.comm;
  if (block_stamps_disagreed(c)) return;  // the call's stamp exchange found the ranks' calls differ (comm.h)
  // A send (with or without the receive) starts epoch e = epochs[8] + 1; a receive alone follows
  // the send launch of the same call, which published e into epochs[8].
  const unsigned long long epoch = c.epochs[kEpochDispatch] + (a.send ? 1 : 0);
  if (a.send) send_tokens<kRows, kRoundScale>(a, epoch);
  if (!a.receive) return;
  const int items = a.blocks_per_expert * a.num_local_experts;
  if (!wait_all_sources(a.peers, kSigDispatchNode + static_cast<int>(epoch & 1), arrivals_after(epoch, gridDim.x),
                        kSigDispatchNet, epoch, kPhaseLowLatencyDispatchRecv)) {
    for (int item = blockIdx.x; item < items; item += gridDim.x)
      if (item % a.blocks_per_expert == 0 && threadIdx.x == 0) a.count[item / a.blocks_per_expert] = 0;  // no rows
    return;
  }
  for (int item = blockIdx.x; item < items; item += gridDim.x)
    receive_expert<kRows>(a, epoch, item / a.blocks_per_expert, item % a.blocks_per_expert);
}

void launch_dispatch(const LowLatencyParams& p, const DispatchLaunchArgs& call, uintptr_t stream) {
  DispatchArgs a{};
  a.peers = make_peers(p);
  a.payload_offset = p.dispatch_payload_offset;
  a.meta_offset = p.dispatch_meta_offset;
  a.x = reinterpret_cast<const uint4*>(call.x);
  a.topk_idx = reinterpret_cast<const int64_t*>(call.topk_idx);
  a.num_tokens = call.num_tokens;
  a.done = reinterpret_cast<int*>(p.done_counters);
  a.global_scale = reinterpret_cast<const float*>(call.x_global_scale);
  a.payload = reinterpret_cast<const uint8_t*>(p.sym + p.dispatch_payload_offset);
  a.meta = reinterpret_cast<const uint8_t*>(p.sym + p.dispatch_meta_offset);
  a.recv_x = reinterpret_cast<uint8_t*>(call.recv_x);
  a.recv_scales = reinterpret_cast<float*>(call.recv_scales);
  a.src_rank = reinterpret_cast<int*>(call.src_rank);
  a.src_index = reinterpret_cast<int*>(call.src_index);
  a.src_k = reinterpret_cast<int*>(call.src_k);
  a.count = reinterpret_cast<int*>(call.count);
  a.num_local_experts = p.num_local_experts;
  a.num_topk = p.num_topk;
  a.hidden = p.hidden;
  a.max_tokens = p.max_tokens;
  a.blocks_per_expert = p.blocks_per_expert;
  a.ue8m0 = call.ue8m0;
  a.send = call.send;
  a.receive = call.receive;
  if (call.use_nvfp4)
    launch_cooperative(dispatch<RowFormat::kNvfp4, false>, kernel_blocks(p), a, stream, "dispatch kernel launch");
  else if (!call.use_fp8)
    launch_cooperative(dispatch<RowFormat::kBf16, false>, kernel_blocks(p), a, stream, "dispatch kernel launch");
  else if (call.round_scale)
    launch_cooperative(dispatch<RowFormat::kFp8, true>, kernel_blocks(p), a, stream, "dispatch kernel launch");
  else
    launch_cooperative(dispatch<RowFormat::kFp8, false>, kernel_blocks(p), a, stream, "dispatch kernel launch");
}

}  // namespace ll
}  // namespace moe_ep
