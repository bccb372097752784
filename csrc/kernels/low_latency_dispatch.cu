// Low-latency dispatch: every token travels once to each rank that holds at least one of its
// experts (NVLink peer stores into that rank's symmetric staging), and the receiver expands the
// staged tokens into expert-major rows [E_l, R*T, H] packed by (source rank, source token).
//
// Protocol (one call = dispatch_send_kernel, then dispatch_recv_kernel, same stream; with the
// receive hook the second launch is deferred to hook()):
//
// dispatch_send_kernel — grid G = min(T, 1024) blocks whatever N is (dispatch_send_blocks; every rank
// uses the same G, so receivers know how many arrivals to wait for); block b takes tokens b, b + G, ...
// One thread per 16 channels (FP8) or 8 channels (bf16), at most 1024 threads. Every block reads
// the call's epoch e = epochs[8] + 1 and uses buffer set e & 1 and the slots of that parity.
//   0. Block 0's threads d < R store (e << 32) | N into slot 12 + (e & 1) [me] at rank d.
//   1. Per token: every thread first issues the loads of its channels of x (step 2), so their latency
//      overlaps the routing. Warp 0 derives it: lane k < K reads topk id k (one coalesced load) and
//      computes its rank and local expert id (32-bit division); an OR-reduction gives the set of
//      destination ranks (to shared memory, slot by token iteration parity), and lanes d < R build by
//      shuffles and write the token's meta row at rank d: its local expert id at d for each k (-1
//      elsewhere, padded to 16), to meta[set][me][t] — for every rank, so a receiver can tell "not
//      for me" from stale data without any other count. A block barrier publishes the set.
//   2. FP8: each thread holds 16 channels (two int4), the 8 threads of a 128-channel block reduce
//      amax by shuffles, and each rank quantises its own token exactly once; bf16: one int4 per
//      thread. The 16-byte chunk (and the block scale) is stored to payload[set][me][t] at each
//      destination rank through its peer pointer (own rank included).
//   3. finish_send_block (low_latency.h): the block joins, thread 0 issues one fence.acq_rel.sys
//      (cumulative over the block's stores) and adds 1 (relaxed) to slot 8 + (e & 1) [me] at every
//      rank. No block waits for another; the last block to finish (local counter) writes
//      epochs[8] = e for the receive kernel.
// dispatch_recv_kernel — grid (P, E_l), 512 threads; block (p, e) serves local expert e;
// P = 256 / E_l (1 to 32, from the Buffer's dimensions), so the grid is about one wave and skewed
// experts get more warps.
//   1. Reads e = epochs[8] (published by the send kernel before it). Thread 0 waits (relaxed
//      polls, then one acquire fence; timeout -> ErrorState naming rank and phase
//      LowLatencyDispatchRecv) until each source r's block counter in slot 8 + (e & 1) reaches
//      G * ((e + 1) / 2) (all G blocks of every epoch of this parity up to e), then takes N_r from
//      the low 32 bits of slot 12 + (e & 1) [r], which r's block 0 stored before its release; a
//      barrier hands the data to the block.
//   2. Scans every staged meta row (s, t < N_s) in (s, t) order, contiguous chunks per thread,
//      and counts the tokens naming e (once per token, at its first k). A block-wide exclusive scan
//      of the per-thread counts gives each token's row: deterministic, no atomics. Rows m with
//      m % P == p are this block's: it writes src_rank / src_index / src_k (first k naming e, for
//      combine) for them, and keeps the staged token of its first 1024 rows in shared memory; block
//      p == 0 writes count[e]. All P blocks of e compute the same scan.
//   3. After a barrier, the block's rows are cut into 4 KB chunks (plus, with FP8, one item for the
//      row's scales), and the (row, chunk) items are spread over all warps: a warp loads its chunk
//      from the local staging (8 int4 per lane, all in flight) and stores it into recv_x[e][m], so
//      each item costs about one round trip whatever the rows per block.
//
// Why the staging of a set is never overwritten while a receiver still reads it: rank s writes set
// (e & 1) at rank d during its send of epoch e. d last read that set in its receive of epoch e - 2.
// d's receive of e - 2 precedes (stream order) d's send of e - 1, whose arrivals rank s waits for in its
// receive of e - 1, which precedes s's send of e. Every receive waits for every source's blocks, even
// from ranks that sent no tokens, so the chain exists for every pair (s, d). The same chain covers
// the count slot, which therefore still holds epoch e's token count when d reads it, and the
// block counter of parity e & 1, which gets no add of epoch e + 2 before d's receive of e has read
// it. It needs each rank to run a call's receive half before the next dispatch's send half: the
// engine enforces that hook() is called before the next low_latency_dispatch.
//
// FP8 arithmetic matches moe_ep.fp8.quantize bit for bit: amax over 128 channels in float32 (exact),
// clamped to >= 1e-4; scale = amax / 448 by IEEE division (__fdiv_rn), or with round_scale the
// smallest power of two >= that quotient (exponent bump when the mantissa is non-zero, which equals
// frexp's answer); values x / scale by __fdiv_rn, converted to e4m3 round-to-nearest-even with
// saturation to finite (|x| <= amax makes |x / scale| at most a few ulps above 448, far below 464
// where torch's conversion would give NaN, so both round to the same finite value). Both divisions
// are true IEEE divisions: on CUDA, torch turns `tensor / python_float` into a multiply by the
// rounded reciprocal, so the reference must divide by a tensor to match (moe_ep/fp8.py).
//
// The output rows (recv_x, scales, src_*, count) are ordinary device memory in two sets that the
// host alternates per call (a CUDA graph replays into the set it captured); only the staging and
// the signals follow the device epoch's parity.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "kernels/low_latency.h"

namespace moe_ep {
namespace ll {
namespace {

constexpr int kRecvThreads = 512;
constexpr int kSharedRows = 1024;  // block rows whose staged token stays in shared memory (others: src_*)

struct DispatchSendArgs {
  Comm comm;
  uint8_t* payload[kMaxRanks];  // each rank's dispatch payload area (set 0), as addressed here
  int16_t* meta[kMaxRanks];     // each rank's dispatch meta area (set 0)
  const uint4* x;               // [N, H] bf16
  const int64_t* topk_idx;      // [N, K]
  int num_tokens;
  int num_local_experts;
  int num_topk;
  int hidden;
  int max_tokens;
  int* done;
};

struct DispatchRecvArgs {
  Comm comm;
  const uint8_t* payload;  // this rank's dispatch payload area
  const int16_t* meta;     // this rank's dispatch meta area
  uint8_t* recv_x;
  float* recv_scales;
  int* src_rank;
  int* src_index;
  int* src_k;
  int* count;
  int num_topk;
  int hidden;
  int max_tokens;
  int send_blocks;  // every rank's dispatch send grid (dispatch_send_blocks)
};

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

// Send half; protocol in the file comment (dispatch_send_kernel).
template <bool kFp8, bool kRoundScale>
__global__ void __launch_bounds__(1024) dispatch_send_kernel(const DispatchSendArgs a) {
  __shared__ unsigned dest_masks[2];  // by token iteration parity: no barrier needed before reuse
  const Comm& c = a.comm;
  const unsigned long long epoch = c.epochs[kEpochDispatch] + 1;
  const int set = static_cast<int>(epoch & 1);
  if (blockIdx.x == 0 && threadIdx.x < static_cast<unsigned>(c.nranks))
    *signal_at(c, threadIdx.x, kSigDispatchCount + set, c.rank) =
        (static_cast<uint64_t>(epoch) << 32) | static_cast<uint32_t>(a.num_tokens);
  constexpr int kChannels = kFp8 ? 16 : 8;  // channels per thread and step
  constexpr int kVecs = kChannels / 8;      // uint4 loads per thread and step
  const int chunks = a.hidden / kChannels;
  int it = 0;
  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x, ++it) {  // block-uniform (barrier, shuffles)
    const uint4* src = a.x + static_cast<size_t>(t) * (a.hidden / 8);
    uint4 first[kVecs];  // this thread's first step, loaded before the routing so both latencies overlap
#pragma unroll
    for (int u = 0; u < kVecs; ++u)
      first[u] = static_cast<int>(threadIdx.x) < chunks ? src[kVecs * threadIdx.x + u] : make_uint4(0, 0, 0, 0);
    const size_t slot = static_cast<size_t>(set * c.nranks + c.rank) * a.max_tokens + t;
    if (threadIdx.x < 32) {  // warp 0: lane k owns topk id k; lanes d < R write rank d's meta row
      const int lane = threadIdx.x;
      const int e = lane < a.num_topk ? static_cast<int>(a.topk_idx[static_cast<size_t>(t) * a.num_topk + lane]) : -1;
      const int dst_rank = e >= 0 ? e / a.num_local_experts : -1;
      const int local = e >= 0 ? e - dst_rank * a.num_local_experts : -1;
      const unsigned mask = __reduce_or_sync(0xffffffffu, dst_rank >= 0 ? 1u << dst_rank : 0u);
      unsigned w[kMetaEntries / 2];
#pragma unroll
      for (int i = 0; i < kMetaEntries / 2; ++i) {
        unsigned pair = 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int k = 2 * i + h;
          const int r = __shfl_sync(0xffffffffu, dst_rank, k);
          const int l = __shfl_sync(0xffffffffu, local, k);
          pair |= (static_cast<unsigned>(r == lane ? l : -1) & 0xffffu) << (16 * h);
        }
        w[i] = pair;
      }
      if (lane < c.nranks) {
        uint4* dst = reinterpret_cast<uint4*>(a.meta[lane] + slot * kMetaEntries);
        dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
        dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
      }
      if (lane == 0) dest_masks[it & 1] = mask;
    }
    __syncthreads();
    const unsigned dest_mask = dest_masks[it & 1];
    const size_t row_offset = slot * 2 * static_cast<size_t>(a.hidden);
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
        for (int d = 0; d < c.nranks; ++d) {
          if (!(dest_mask >> d & 1u)) continue;
          uint8_t* row = a.payload[d] + row_offset;
          reinterpret_cast<uint4*>(row)[i] = q;
          if ((i & 7) == 0) reinterpret_cast<float*>(row + a.hidden)[i >> 3] = scale;
        }
      } else {
        if (!active) continue;
        for (int d = 0; d < c.nranks; ++d)
          if (dest_mask >> d & 1u) reinterpret_cast<uint4*>(a.payload[d] + row_offset)[i] = v[0];
      }
    }
  }
  finish_send_block(c, a.done, kSigDispatch + set, kEpochDispatch, epoch);
}

// First k at which staged token j = s * T + t names local expert e, or -1 (also when t >= N_s).
__device__ __forceinline__ int first_k(const DispatchRecvArgs& a, const int* tokens, int set, int j, int e) {
  const int s = j / a.max_tokens, t = j - s * a.max_tokens;
  if (t >= tokens[s]) return -1;
  const uint4* m = reinterpret_cast<const uint4*>(
      a.meta + (static_cast<size_t>(set * a.comm.nranks) * a.max_tokens + j) * kMetaEntries);
  const uint4 q0 = m[0];
  const uint4 q1 = a.num_topk > 8 ? m[1] : make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
  const unsigned w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
  for (int k = 0; k < kMetaEntries; ++k) {
    const int local = static_cast<int16_t>(w[k >> 1] >> (16 * (k & 1)));
    if (k < a.num_topk && local == e) return k;
  }
  return -1;
}

// Exclusive prefix sum of `v` over the block (blockDim.x a multiple of 32); *total gets the sum.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  *total = warp_sums[warps - 1];
  return (warp > 0 ? warp_sums[warp - 1] : 0) + incl - v;
}

// Receive half; protocol in the file comment (dispatch_recv_kernel).
template <bool kFp8>
__global__ void __launch_bounds__(kRecvThreads, 2) dispatch_recv_kernel(const DispatchRecvArgs a) {
  __shared__ int tokens[kMaxRanks];
  __shared__ int warp_sums[32];
  __shared__ int staged_j[kSharedRows];  // staged token (s * T + t) of the block's first rows
  __shared__ int ok;
  const Comm& c = a.comm;
  const unsigned long long epoch = c.epochs[kEpochDispatch];
  const int set = static_cast<int>(epoch & 1);
  if (!wait_all_sources(c, kSigDispatch + set, arrivals_after(epoch, a.send_blocks), kPhaseLowLatencyDispatchRecv,
                        kSigDispatchCount + set, tokens, &ok))
    return;

  const int e = blockIdx.y, p = blockIdx.x, parts = gridDim.x;
  const int capacity = c.nranks * a.max_tokens;
  const int per_thread = (capacity + blockDim.x - 1) / blockDim.x;
  const int j0 = min(static_cast<int>(threadIdx.x) * per_thread, capacity);
  const int j1 = min(j0 + per_thread, capacity);
  int mine = 0;
  for (int j = j0; j < j1; ++j) mine += first_k(a, tokens, set, j, e) >= 0;
  int total;
  int m = block_exclusive_scan(mine, warp_sums, &total);
  const size_t expert_row0 = static_cast<size_t>(e) * capacity;
  for (int j = j0; j < j1; ++j) {
    const int k = first_k(a, tokens, set, j, e);
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
  __syncthreads();

  // Copy items: (block row, chunk) pairs spread over all warps, one round trip each; with FP8 one
  // more item per row moves its scales.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const size_t staged_bytes = 2 * static_cast<size_t>(a.hidden);
  const int row_int4 = kFp8 ? a.hidden / 16 : a.hidden / 8;
  const int row_chunks = chunks_of(row_int4);
  const int items_per_row = row_chunks + (kFp8 ? 1 : 0);
  const int block_rows = total > p ? (total - p + parts - 1) / parts : 0;
  for (int item = warp; item < block_rows * items_per_row; item += warps) {
    const int r = item / items_per_row, chunk = item - r * items_per_row;
    const size_t row = expert_row0 + p + static_cast<size_t>(parts) * r;
    const int j = r < kSharedRows ? staged_j[r] : a.src_rank[row] * a.max_tokens + a.src_index[row];
    const uint8_t* staged = a.payload + (static_cast<size_t>(set * c.nranks) * a.max_tokens + j) * staged_bytes;
    if (chunk < row_chunks) {
      int4 v[kCopyUnroll];
      warp_load_chunk(v, reinterpret_cast<const int4*>(staged), row_int4, chunk, lane);
      warp_store_chunk(reinterpret_cast<int4*>(a.recv_x + row * row_int4 * 16), v, row_int4, chunk, lane);
    } else {
      const int scales = a.hidden / 128;
      const float* staged_scales = reinterpret_cast<const float*>(staged + a.hidden);
      float* out_scales = a.recv_scales + row * scales;
      for (int i = lane; i < scales; i += 32) out_scales[i] = staged_scales[i];
    }
  }
}

}  // namespace

void dispatch_send(const LowLatencyParams& p, uintptr_t x, uintptr_t topk_idx, int num_tokens, bool use_fp8,
                   bool round_scale, uintptr_t stream) {
  DispatchSendArgs a{};
  a.comm = make_comm(p);
  for (int r = 0; r < p.nranks; ++r) {
    a.payload[r] = reinterpret_cast<uint8_t*>(p.sym[r] + p.dispatch_payload_offset);
    a.meta[r] = reinterpret_cast<int16_t*>(p.sym[r] + p.dispatch_meta_offset);
  }
  a.x = reinterpret_cast<const uint4*>(x);
  a.topk_idx = reinterpret_cast<const int64_t*>(topk_idx);
  a.num_tokens = num_tokens;
  a.num_local_experts = p.num_local_experts;
  a.num_topk = p.num_topk;
  a.hidden = p.hidden;
  a.max_tokens = p.max_tokens;
  a.done = reinterpret_cast<int*>(p.done_counters);
  const int chunks = p.hidden / (use_fp8 ? 16 : 8);  // one chunk per thread (send kernel)
  const int threads = chunks >= 1024 ? 1024 : ((chunks + 31) / 32) * 32;
  const dim3 grid(dispatch_send_blocks(p));
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (!use_fp8)
    dispatch_send_kernel<false, false><<<grid, threads, 0, s>>>(a);
  else if (round_scale)
    dispatch_send_kernel<true, true><<<grid, threads, 0, s>>>(a);
  else
    dispatch_send_kernel<true, false><<<grid, threads, 0, s>>>(a);
  check_launch("dispatch send kernel launch");
}

void dispatch_recv(const LowLatencyParams& p, uintptr_t recv_x, uintptr_t recv_scales, uintptr_t src_rank,
                   uintptr_t src_index, uintptr_t src_k, uintptr_t count, bool use_fp8, uintptr_t stream) {
  DispatchRecvArgs a{};
  a.comm = make_comm(p);
  a.payload = reinterpret_cast<const uint8_t*>(p.sym[p.rank] + p.dispatch_payload_offset);
  a.meta = reinterpret_cast<const int16_t*>(p.sym[p.rank] + p.dispatch_meta_offset);
  a.recv_x = reinterpret_cast<uint8_t*>(recv_x);
  a.recv_scales = reinterpret_cast<float*>(recv_scales);
  a.src_rank = reinterpret_cast<int*>(src_rank);
  a.src_index = reinterpret_cast<int*>(src_index);
  a.src_k = reinterpret_cast<int*>(src_k);
  a.count = reinterpret_cast<int*>(count);
  a.num_topk = p.num_topk;
  a.hidden = p.hidden;
  a.max_tokens = p.max_tokens;
  a.send_blocks = dispatch_send_blocks(p);
  const dim3 grid(p.blocks_per_expert, p.num_local_experts);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (use_fp8)
    dispatch_recv_kernel<true><<<grid, kRecvThreads, 0, s>>>(a);
  else
    dispatch_recv_kernel<false><<<grid, kRecvThreads, 0, s>>>(a);
  check_launch("dispatch receive kernel launch");
}

}  // namespace ll
}  // namespace moe_ep
