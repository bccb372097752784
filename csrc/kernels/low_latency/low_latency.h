// Low-latency (decode) dispatch/combine: host-side parameters and kernel launchers.
//
// This header is plain C++ (no device code, no comm.h) so that the pybind11 bindings compile with
// any host compiler; the .cu files turn LowLatencyParams into a comm.h Comm.
//
// Peers: rank d is in node d / ranks_per_node. A peer in this rank's node is written by loads and
// stores through its NVLink address (node_sym, from nvshmem_ptr on the host); a peer in another
// node only through NVSHMEM device operations (puts from this rank's own symmetric memory, signal
// ops), addressed by the local symmetric address and the peer's PE. The choice follows
// ranks_per_node, never whether nvshmem_ptr happens to reach the peer, so ranks_per_node = 1 runs
// every byte between two GPUs of one machine through the network code. Any R (nothing is sized by
// a per-peer array except the node's at most kMaxNodeRanks peers).
//
// Symmetric region (one allocation, same layout on every rank; byte offsets from region_layout
// below, which moe_ep/comm/backends/low_latency.py reads through moe_ep.comm._C and passes back in
// LowLatencyParams). The staging areas have two sets, picked by the parity of the call's device-side
// epoch:
//   dispatch payload [2][R src][T][2H bytes]  bf16 row, or e4m3 row (H bytes) then H/128 float scales,
//                                             or NVFP4 values (H/2 bytes) then H/16 e4m3 scales (below)
//   dispatch meta    [2][R src][T][48 bytes]  the token's global expert id per k as int16 (-1 past K
//                                             or for topk id -1), 16 of them, then the low 32 bits of
//                                             the epoch that wrote it (tag), then 12 bytes of padding
//   combine payload  [2][T][K][H] bf16        expert output for (token, first k naming that expert)
//   combine scratch  [P * E_l][8][H] bf16     (only with several nodes) rows of a combine send block
//                                             on their way to ranks of other nodes
//   signals          [6][R] uint64            entry [slot][src] written only by rank src:
//     0, 1  dispatch, node peers: blocks of src's dispatch send half that finished storing here, by parity
//     2, 3  combine, node peers: the same for the combine send half
//     4     dispatch, other nodes: the last epoch whose every put from src is complete here
//     5     combine, other nodes: the same for combine
#pragma once
#include <cstddef>
#include <cstdint>

#include "runtime/host_device.h"
#include "runtime/limits.h"

namespace moe_ep {
namespace ll {

constexpr int kMetaBytes = 48;    // one meta row: 16 int16 ids, uint32 epoch tag, padding
constexpr int kScratchRows = 8;   // combine scratch rows per send block (several nodes)
constexpr int kNumSignals = 6;    // signal words per source rank
constexpr uint64_t kRegionAlign = 256;  // every area of the region starts at a multiple of this

// Byte offsets of the region's areas (and its size), in the order of the comment above.
struct RegionLayout {
  uint64_t dispatch_payload, dispatch_meta, combine_payload, combine_scratch, signals, total;
};

// The region of a Buffer with R ranks, T tokens per rank, hidden H and top-k K; scratch_blocks is
// the combine send grid (P * E_l) when the group spans several nodes, else 0.
inline RegionLayout region_layout(int nranks, int max_tokens, int hidden, int num_topk, int scratch_blocks) {
  const auto align = [](uint64_t n) { return (n + kRegionAlign - 1) / kRegionAlign * kRegionAlign; };
  const uint64_t r = nranks, t = max_tokens, h = hidden, k = num_topk;
  RegionLayout l{};
  l.dispatch_payload = 0;
  l.dispatch_meta = align(2 * r * t * 2 * h);
  l.combine_payload = align(l.dispatch_meta + 2 * r * t * kMetaBytes);
  l.combine_scratch = align(l.combine_payload + 2 * t * k * h * 2);
  l.signals = align(l.combine_scratch + static_cast<uint64_t>(scratch_blocks) * kScratchRows * h * 2);
  l.total = align(l.signals + kNumSignals * r * 8);
  return l;
}

// NVFP4 rows (use_nvfp4; DeepEP hybrid-ep's format, recipe in moe_ep/comm/nvfp4.py's docstring): every
// kNvfp4Block channels of a bf16 row share one e4m3 scale, g * amax / kNvfp4E2m1Max for the call's global
// scale g, and the values are e2m1, two per byte (channel 2i in the low nibble of byte i). Received values
// are [E_l, R*T, H/2] uint8, row-major like the bf16 rows. Received scales are, per local expert, CUTLASS's
// 128x4 scale-factor tiles: rm = ceil(R*T / 128) row tiles by rk = ceil(H/16 / 4) scale tiles of 512
// bytes, tile (t / 128, j / 4) holding row t's scale j at byte (t % 32) * 16 + (t % 128) / 32 * 4 + j % 4
// (nvfp4_scale_offset): the (E_l, rm, rk, 32, 4, 4) array that moe_ep/comm/nvfp4.py views as DeepEP's.
// The dispatch writes its padding zero (the scales past H/16 of every received row, the rows past R*T);
// rows in [count, R*T) keep what they held. Python reads these constants as NVFP4_* (bindings.cpp).
constexpr int kNvfp4Block = 16;          // channels per e4m3 scale
constexpr int kNvfp4E2m1Max = 6;         // e2m1's largest magnitude: a scale maps a block's amax to it
constexpr int kNvfp4TileRows = 128;      // rows of one scale tile, in groups of kNvfp4TileGroupRows
constexpr int kNvfp4TileGroupRows = 32;  // row t is row t % 32 of group (t % 128) / 32
constexpr int kNvfp4TileScales = 4;      // scales of one row in one tile: 4 adjacent bytes
constexpr int kNvfp4TileBytes = kNvfp4TileRows * kNvfp4TileScales;

// Scale tiles of one local expert: rm row tiles for `slots` rows (R*T), rk scale tiles for `hidden`.
struct Nvfp4Tiles {
  int rows;    // rm
  int scales;  // rk
};

MOE_EP_HOST_DEVICE inline Nvfp4Tiles nvfp4_tiles(int slots, int hidden) {
  const int scales = hidden / kNvfp4Block;
  return Nvfp4Tiles{(slots + kNvfp4TileRows - 1) / kNvfp4TileRows, (scales + kNvfp4TileScales - 1) / kNvfp4TileScales};
}

// Byte offset of row t's scale j in one local expert's scales of rk = scale_tiles scale tiles.
MOE_EP_HOST_DEVICE inline size_t nvfp4_scale_offset(int scale_tiles, int row, int scale) {
  constexpr int kGroups = kNvfp4TileRows / kNvfp4TileGroupRows;
  const size_t tile = static_cast<size_t>(row / kNvfp4TileRows) * scale_tiles + scale / kNvfp4TileScales;
  return tile * kNvfp4TileBytes + (row % kNvfp4TileGroupRows) * (kGroups * kNvfp4TileScales) +
         (row % kNvfp4TileRows) / kNvfp4TileGroupRows * kNvfp4TileScales + scale % kNvfp4TileScales;
}

struct LowLatencyParams {
  // Comm (see csrc/runtime/comm.h)
  int rank;
  int nranks;
  int ranks_per_node;
  unsigned long long timeout_ns;
  uintptr_t error;                  // ErrorState*, device address of host-mapped memory
  uintptr_t verdict;                // int32, device: the stamp verdict (comm.h)
  uintptr_t epochs;                 // unsigned long long[kNumEpochs], device
  uintptr_t masked;                 // int[nranks], device: fault-tolerant mode's masked ranks; 0 when off
  // dimensions
  int num_local_experts;
  int num_topk;
  int hidden;
  int max_tokens;                   // T
  // symmetric region: this rank's base (also the address that names the region at any PE in a
  // put), the node's ranks' bases as addressed from this GPU ([i] = rank node * ranks_per_node + i),
  // and the area offsets
  uintptr_t sym;
  uintptr_t node_sym[kMaxNodeRanks];
  uint64_t dispatch_payload_offset;
  uint64_t dispatch_meta_offset;
  uint64_t combine_payload_offset;
  uint64_t combine_scratch_offset;
  uint64_t signals_offset;
  // private device state
  uintptr_t done_counters;          // int32[2]: blocks finished in the current send half
                                    // ([0] dispatch, [1] combine); the last block resets it to 0
  uintptr_t combine_stash;          // int64[T*K] topk ids then float32[T*K] weights, copied at send
  int blocks_per_expert;            // P: blocks sharing one local expert (items of kernel_blocks)
  int num_sms;                      // SMs of this rank's GPU (kernel_blocks)
};

constexpr int kBlockThreads = 512;  // threads per block of both kernels

// Grid of both kernels: one block per (local expert, part) item, P * E_l, but at most two blocks per
// SM (each kernel's __launch_bounds__(kBlockThreads, 2) makes two fit), so that every block is resident
// at once: a kernel running both halves waits in its receive half for the send half of every block
// of every rank, its own included (launched cooperatively, so a grid that cannot be co-resident
// fails to launch instead of hanging). Blocks loop over items when the grid is smaller. Fixed per
// Buffer and equal on every rank (the same GPU model): receivers count the senders' block arrivals.
// An overlap combine (combine.cu) launches at most num_sms blocks that run these G as virtual blocks.
inline int kernel_blocks(const LowLatencyParams& p) {
  const int items = p.blocks_per_expert * p.num_local_experts;
  return items < 2 * p.num_sms ? items : 2 * p.num_sms;
}

// The fixed dimensions of one Buffer's low-latency kernels (what the argument checks compare with).
struct Dims {
  int rank;
  int nranks;             // R
  int ranks_per_node;
  int num_local_experts;  // E_l
  int num_topk;           // K
  int hidden;             // H
  int max_tokens;         // T
};

inline Dims dims_of(const LowLatencyParams& p) {
  return Dims{p.rank, p.nranks, p.ranks_per_node, p.num_local_experts, p.num_topk, p.hidden, p.max_tokens};
}

// Low-latency dispatch, one kernel with two halves; `send` and `receive` pick which run (both: one
// launch for the whole call; with the receive hook the send launch now and the receive launch in
// hook()). Send: quantise (optionally) and push every token to each rank holding one of its
// experts, then release its arrival. Receive: wait for every source, expand staged tokens into the
// expert-major rows. Both launches of a call pass the same use_fp8, round_scale, ue8m0 and use_nvfp4.
struct DispatchLaunchArgs {
  uintptr_t x;            // [N, H] bf16 (send half)
  uintptr_t topk_idx;     // [N, K] int64 (send half)
  int num_tokens;         // N
  uintptr_t recv_x;       // [E_l, R*T, H] bf16, or e4m3 with use_fp8, or with use_nvfp4 [E_l, R*T, H/2]
                          // uint8 (receive half, as the five below)
  uintptr_t recv_scales;  // use_fp8: [E_l, H/128, R*T] float32, or with ue8m0 [E_l, H/512, R*T] int32
                          // (DeepEP's layout: the result is its [E_l, R*T, ...] transpose); use_nvfp4:
                          // E_l * rm * rk tiles of e4m3 (the NVFP4 comment above); else 0
  uintptr_t src_rank;     // [E_l, R*T] int32
  uintptr_t src_index;    // [E_l, R*T] int32
  uintptr_t src_k;        // [E_l, R*T] int32
  uintptr_t count;        // [E_l] int32
  bool use_fp8;
  bool round_scale;       // power-of-two scales (use_fp8 only)
  bool ue8m0;             // scales as UE8M0 exponent bytes, 4 per int32 (needs round_scale, hidden % 512 == 0)
  bool use_nvfp4;         // NVFP4 rows (excludes use_fp8; hidden % 16 == 0)
  uintptr_t x_global_scale;  // use_nvfp4: float32 on the device, its first element is g (send half); else 0
  bool send;
  bool receive;
};

// Low-latency combine, one kernel with two halves as above. Send: push every received row's expert
// output back to its token's rank; this rank's own topk_idx and topk_weights are stashed for the
// receive half. Receive: wait for every rank, then out[n] = bf16(sum_k w[n,k] * row) in ascending k.
// Overlap (SGLang's single-batch overlap, combine.cu's file comment): both launches of the call run
// on at most num_sms blocks, and the send half reads a row of y only once the GEMM writing y beside
// it has signalled the row's block in comp_signal.
struct CombineLaunchArgs {
  uintptr_t y;             // [E_l, R*T, H] bf16 (send half, as the six below)
  uintptr_t src_rank;      // [E_l, R*T] int32, from the dispatch
  uintptr_t src_index;     // [E_l, R*T] int32, from the dispatch
  uintptr_t src_k;         // [E_l, R*T] int32, from the dispatch
  uintptr_t count;         // [E_l] int32, from the dispatch
  uintptr_t topk_idx;      // [N, K] int64 of this rank's own tokens
  uintptr_t topk_weights;  // [N, K] float32 of this rank's own tokens
  int num_tokens;          // N
  uintptr_t out;           // [N, H] bf16 (receive half)
  int num_sms;             // > 0: overlap, at most this many blocks per launch and the waits below;
                           // 0: no overlap, kernel_blocks blocks (the three below then 0)
  uintptr_t comp_signal;   // overlap: int32 [E_l * ceil(R*T / block_m)], row m of expert e is read once
                           // comp_signal[e * ceil(R*T / block_m) + m / block_m] >= threshold (send half)
  int block_m;             // overlap: rows per signal word
  int threshold;           // overlap: signal value of a finished block
  bool send;
  bool receive;
};

// The launchers. LowLatencyContext (bindings.cpp in this folder) checks the argument struct first
// (check(dims, args): a pointer the launch's halves and sizes say it uses must not be 0, a size must
// fit the Dims).
void launch_dispatch(const LowLatencyParams& p, const DispatchLaunchArgs& a, uintptr_t stream);
void launch_combine(const LowLatencyParams& p, const CombineLaunchArgs& a, uintptr_t stream);

// The dispatch kernel's NVFP4 cast (nvfp4.cuh) run on the host, so that tests without a GPU compare its
// bytes with moe_ep.comm.nvfp4.quantize: host memory in, host memory out, row-major.
struct Nvfp4HostCastArgs {
  uintptr_t x;         // [num_rows, hidden] bf16
  int num_rows;
  int hidden;          // a multiple of kNvfp4Block
  float global_scale;  // g
  uintptr_t values;    // [num_rows, hidden / 2] uint8
  uintptr_t scales;    // [num_rows, hidden / 16] e4m3
};
void nvfp4_cast_host(const Nvfp4HostCastArgs& a);

}  // namespace ll
}  // namespace moe_ep

#if defined(__CUDACC__)
// Device-side pieces shared by dispatch.cu and combine.cu in this folder.
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

#include "runtime/comm.h"

namespace moe_ep {
namespace ll {


// Signal words ([slot][src] in the region's signals area, see the file comment). A call with epoch
// e uses staging set e & 1 and the node slots of that parity. The node block counters only grow:
// after epoch e, slot (e & 1) holds G * ((e + 1) / 2) for a source in the node, G being the fixed
// grid size of both kernels (kernel_blocks: the same on every rank). The
// network words hold epochs, which only grow.
constexpr int kSigDispatchNode = 0;  // 0, 1
constexpr int kSigCombineNode = 2;   // 2, 3
constexpr int kSigDispatchNet = 4;
constexpr int kSigCombineNet = 5;
constexpr int kEpochDispatch = kSigLowLatencyFirst;     // epochs[8]: last dispatch epoch sent
constexpr int kEpochCombine = kSigLowLatencyFirst + 2;  // epochs[10]: last combine epoch sent

// Everything a kernel needs to reach its peers.
struct Peers {
  Comm comm;                           // rank, nranks, timeout, error state, epochs (signals unused)
  int node_first;                      // first rank of this rank's node
  int node_ranks;                      // ranks per node
  bool network;                        // the group spans several nodes
  uint8_t* sym;                        // this rank's region (symmetric address for puts)
  uint8_t* node_sym[kMaxNodeRanks];    // the node's ranks' regions, as addressed from this GPU
  uint64_t signals_offset;
};

inline Peers make_peers(const LowLatencyParams& p) {
  Peers s{};
  s.comm.rank = p.rank;
  s.comm.nranks = p.nranks;
  s.comm.timeout_ns = p.timeout_ns;
  s.comm.error = reinterpret_cast<ErrorState*>(p.error);
  s.comm.verdict = reinterpret_cast<const int*>(p.verdict);
  s.comm.epochs = reinterpret_cast<unsigned long long*>(p.epochs);
  s.comm.masked = reinterpret_cast<int*>(p.masked);
  s.node_first = p.rank - p.rank % p.ranks_per_node;
  s.node_ranks = p.ranks_per_node;
  s.network = p.ranks_per_node < p.nranks;
  s.sym = reinterpret_cast<uint8_t*>(p.sym);
  for (int i = 0; i < p.ranks_per_node; ++i) s.node_sym[i] = reinterpret_cast<uint8_t*>(p.node_sym[i]);
  s.signals_offset = p.signals_offset;
  return s;
}

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("moe_ep low-latency ") + what + ": " + cudaGetErrorString(err));
}

// Launches kernel(args) on `blocks` blocks of kBlockThreads (kernel_blocks(p), or fewer for an overlap
// combine), cooperatively (all blocks resident).
template <typename Args>
void launch_cooperative(void (*kernel)(Args), int blocks, const Args& args, uintptr_t stream, const char* what) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kBlockThreads);
  cfg.stream = reinterpret_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args);
  if (err != cudaSuccess) throw std::runtime_error(std::string("moe_ep low-latency ") + what + ": " + cudaGetErrorString(err));
  check_launch(what);
}

__device__ __forceinline__ bool in_node(const Peers& s, int d) {
  return static_cast<unsigned>(d - s.node_first) < static_cast<unsigned>(s.node_ranks);
}

// Byte `offset` of node rank d's region, as addressed from this GPU (d must be in_node).
__device__ __forceinline__ uint8_t* node_addr(const Peers& s, int d, size_t offset) {
  return s.node_sym[d - s.node_first] + offset;
}

// Signal word [slot][src] in the region at `base` (this rank's, or a node rank's).
__device__ __forceinline__ uint64_t* signal_word(const Peers& s, uint8_t* base, int slot, int src) {
  return reinterpret_cast<uint64_t*>(base + s.signals_offset) + static_cast<size_t>(slot) * s.comm.nranks + src;
}

// Value of a send half's node block counter (slot of e's parity) once all `blocks` blocks of every
// epoch <= e with that parity have arrived.
__device__ __forceinline__ uint64_t arrivals_after(unsigned long long epoch, int blocks) {
  return static_cast<uint64_t>(blocks) * ((epoch + 1) >> 1);
}

// A copy chunk: one warp moves up to kChunkUnits units with every load in flight before any store
// (one memory round trip per chunk). A unit V is an int4 (a chunk is 4 KB), or an int2 where a row is
// a multiple of 8 bytes only (dispatch.cu's NVFP4 rows). Rows are cut into chunks so that all warps of
// a block share the rows instead of one warp walking a whole row through several dependent round trips.
constexpr int kChunkUnroll = 8;
constexpr int kChunkUnits = 32 * kChunkUnroll;

__device__ __forceinline__ int chunks_of(int n_units) { return (n_units + kChunkUnits - 1) / kChunkUnits; }

// Loads units [chunk * kChunkUnits, min(n, (chunk + 1) * kChunkUnits)) of src into v (lane's share).
template <typename V>
__device__ __forceinline__ void warp_load_chunk(V (&v)[kChunkUnroll], const V* src, int n, int chunk, int lane) {
#pragma unroll
  for (int u = 0; u < kChunkUnroll; ++u) {
    const int i = chunk * kChunkUnits + u * 32 + lane;
    if (i < n) v[u] = src[i];
  }
}

// Stores what warp_load_chunk loaded for the same (n, chunk, lane).
template <typename V>
__device__ __forceinline__ void warp_store_chunk(V* dst, const V (&v)[kChunkUnroll], int n, int chunk, int lane) {
#pragma unroll
  for (int u = 0; u < kChunkUnroll; ++u) {
    const int i = chunk * kChunkUnits + u * 32 + lane;
    if (i < n) dst[i] = v[u];
  }
}

// A rank whose data a kernel must skip: masked in fault-tolerant mode (a plain load; in a receive
// half after the block's wait_all_sources, so a rank masked later during the kernel may still be
// used by it). A send half neither writes to nor signals a masked rank: if that rank comes back,
// it times out waiting for this one and masks it in turn, instead of reading rows never sent.
__device__ __forceinline__ bool skip_rank(const Comm& c, int r) { return c.masked != nullptr && c.masked[r] != 0; }

// End of every block's send half. The block joins; then thread 0:
//   - with several nodes, nvshmem_quiet(): every put this PE issued so far, so all of this block's,
//     is complete at its target (NVSHMEM's quiet guarantee; puts by other threads of the block were
//     issued before the barrier);
//   - one fence.acq_rel.sys and a relaxed add of 1 to this rank's node block counter in
//     `node_slot` at every rank of the node (a release pattern, cumulative over the barrier: every
//     thread's NVLink stores to node ranks are performed before the add; one fence per block);
//   - counts the block done locally. The last of the `blocks` send blocks (the grid, or G virtual
//     blocks, combine.cu; it has seen every other block's count, so no block still reads the epoch:
//     every launched block counts at least one) publishes `epoch` into epochs[epoch_index] for a receive-only
//     launch that follows in the stream and resets the local counter (send halves never wait, so
//     it always resets). With several nodes it first issues fence.acq_rel.sys (an acquire after
//     seeing every block's count: where a transport's puts are plain stores, e.g. P2P, they are
//     ordered before the signals too), then its threads set `net_slot` [me] to `epoch` at every rank
//     of another node (nvshmemx_signal_op, NVSHMEM_SIGNAL_SET): every block quieted its puts before
//     it counted itself done, so each signal is issued after all of this call's puts to that rank
//     completed, whatever transport carries them.
__device__ __forceinline__ void finish_send_block(const Peers& s, int* done, int blocks, int node_slot, int net_slot,
                                                  int epoch_index, unsigned long long epoch) {
  __shared__ int last;
  const Comm& c = s.comm;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (s.network) nvshmem_quiet();
    fence_acq_rel_sys();
    for (int i = 0; i < s.node_ranks; ++i)
      if (!skip_rank(c, s.node_first + i)) red_add_relaxed_sys(signal_word(s, s.node_sym[i], node_slot, c.rank), 1);
    last = atomicAdd(done, 1) == blocks - 1;
    if (last) {
      if (s.network) fence_acq_rel_sys();  // acquire: every block's completed puts before the signals
      c.epochs[epoch_index] = epoch;
      *done = 0;
    }
  }
  if (!s.network) return;
  __syncthreads();
  if (!last) return;
  for (int d = threadIdx.x; d < c.nranks; d += blockDim.x)
    if (!in_node(s, d) && !skip_rank(c, d))
      nvshmemx_signal_op(signal_word(s, s.sym, net_slot, c.rank), epoch, NVSHMEM_SIGNAL_SET, d);
}

// Every block of a receive half waits for every source's send of `epoch`: thread i waits for the
// sources r = i, i + blockDim.x, ... A source in the node: its block counter in `node_slot` reaches
// `node_target` (relaxed polls, then one acquire load: wait_geq, pairing with finish_send_block's
// release). A source in another node: its network word in `net_slot` reaches `epoch`
// (wait_signal_geq: the signal was issued after the source's puts completed, and the fence after
// the observing fetch orders this thread's later loads after it). The block barrier then hands the
// acquired data to all threads. Returns false when a wait timed out (recorded in ErrorState with
// rank, peer and phase); the block must then poison its outputs and leave. In fault-tolerant mode
// (Comm::masked) a source that misses the timeout is masked instead, a masked source is not waited
// for, and the call goes on: the caller skips masked sources' data (read the mask after this wait).
__device__ __forceinline__ bool wait_all_sources(const Peers& s, int node_slot, uint64_t node_target, int net_slot,
                                                 unsigned long long epoch, int phase) {
  const Comm& c = s.comm;
  int ok = 1;
  for (int r = threadIdx.x; ok && r < c.nranks; r += blockDim.x)
    ok = (in_node(s, r) ? wait_geq(c, signal_word(s, s.sym, node_slot, r), node_target, phase, r)
                        : wait_signal_geq(c, signal_word(s, s.sym, net_slot, r), epoch, phase, r)) ||
         peer_masked(c, r);
  return __syncthreads_and(ok) != 0;
}



}  // namespace ll
}  // namespace moe_ep
#endif  // __CUDACC__
