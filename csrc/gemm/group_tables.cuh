// The per-group tables CUTLASS's grouped GEMM reads (problem shape, operand and scale addresses, strides, scale
// layouts, one entry per expert), carved out of the caller's workspace and written on the device from the
// expert counts, so the host never learns the group sizes (no synchronisation); and the kernel that zeros the
// output of the groups the GEMM skips where the caller wants zeros there (the weight gradient).
//
// Protocol of write_group_tables (one block of kTableThreads, on the GEMM's stream before it): thread t owns the
// groups [t * per, (t + 1) * per), per = ceil(groups / kTableThreads). Counts are clipped first: negative counts
// count as 0, and group g keeps n_g = min(count, bound - min(before, bound)) of its items, `before` the
// (unclipped) items of the groups before it, so the running sum never passes `bound` (a bad count cannot make
// the GEMM read or write past the caller's tensors). Two block-wide exclusive prefix sums (Hillis-Steele in
// shared memory, log2(kTableThreads) steps each) give each thread first the items before its groups (for the
// clipping), then the placement before its groups (the Layout's Footprint summed over the groups before them);
// each thread then walks its groups and writes the entry the Layout derives from (g, n_g, placement).
// The two Layouts:
//   RowGrouped (grouped_gemm: rows of a and out grouped by expert; Footprint: rows), group g at row r0:
//     shape  (n_g, n, k)              a    a + r0 * k         a_scale  a_scale + r0 * k / 128
//     b      b + g * n * k            b_scale  b_scale + g * (n / 128) * (k / 128)
//     out    out + r0 * n             strides: a and b rows k elements apart, out rows n apart
//   KGrouped (wgrad_gemm: the reduction dimension grouped; Footprint: 16-aligned columns and 128-token scale
//     blocks), group g at column c and scale block s:
//     shape  (n_g > 0 ? m : 0, n, n_g)   a  a + c   b  b + c   a_scale  a_scale + m * s   b_scale  b_scale + n * s
//     out    out + g * m * n          strides: a and b rows `columns` apart, out rows n apart
// Both: scale layouts Gemm::ScaleConfig's K-major layouts for the entry's (M, N, K) (the ones the mainloop
// derives itself from the shape). A group with M = 0 has no tiles; CUTLASS's group scheduler skips it and reads
// none of its entries (so K = 0, which would leave CUTLASS's accumulators unset, never reaches the GEMM).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"

namespace moe_ep {
namespace gemm {

constexpr int kTableThreads = 256;
constexpr size_t kTableAlign = 128;  // every table, and the CUTLASS workspace after them (tensor maps: 64 B)

inline size_t align_up(size_t bytes) { return (bytes + kTableAlign - 1) / kTableAlign * kTableAlign; }

// The device tables of one call for the CUTLASS GEMM type bundle G (fp8_grouped_gemm_sm90.cuh's GemmOf).
template <class G>
struct GroupTables {
  using Shape = typename G::ProblemShape::UnderlyingProblemShape;

  Shape* shapes;
  const typename G::ElementAB** a;
  const typename G::ElementAB** b;
  typename G::ElementD** out;
  const float** a_scale;
  const float** b_scale;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_out;
  typename G::LayoutSFA* layout_a_scale;
  typename G::LayoutSFB* layout_b_scale;

  // Bytes of all tables for `groups` groups, each table starting kTableAlign-aligned.
  static size_t bytes(int64_t groups) {
    const size_t g = static_cast<size_t>(groups);
    return align_up(g * sizeof(Shape)) + 5 * align_up(g * sizeof(void*)) +
           align_up(g * sizeof(typename G::StrideA)) + align_up(g * sizeof(typename G::StrideB)) +
           align_up(g * sizeof(typename G::StrideD)) + align_up(g * sizeof(typename G::LayoutSFA)) +
           align_up(g * sizeof(typename G::LayoutSFB));
  }

  // The tables laid out from `base` (kTableAlign-aligned) in the order bytes() counts them.
  static GroupTables carve(uintptr_t base, int64_t groups) {
    const size_t g = static_cast<size_t>(groups);
    GroupTables t{};
    uintptr_t at = base;
    const auto take = [&](auto*& table, size_t entry_bytes) {
      table = reinterpret_cast<std::remove_reference_t<decltype(table)>>(at);
      at += align_up(g * entry_bytes);
    };
    take(t.shapes, sizeof(Shape));
    take(t.a, sizeof(void*));
    take(t.b, sizeof(void*));
    take(t.out, sizeof(void*));
    take(t.a_scale, sizeof(void*));
    take(t.b_scale, sizeof(void*));
    take(t.stride_a, sizeof(typename G::StrideA));
    take(t.stride_b, sizeof(typename G::StrideB));
    take(t.stride_out, sizeof(typename G::StrideD));
    take(t.layout_a_scale, sizeof(typename G::LayoutSFA));
    take(t.layout_b_scale, sizeof(typename G::LayoutSFB));
    return t;
  }
};

// The group sizes of one call: counts [groups] int32 on the device, clipped to `bound` items in all.
struct GroupCounts {
  const int32_t* counts;
  int64_t groups;
  int64_t bound;
};

// The device base addresses of one call's operands.
struct Operands {
  uintptr_t a, a_scale, b, b_scale, out;
};

// One group's entry: its problem shape, the element offsets of its operands from Operands' bases, row strides.
struct GroupEntry {
  int64_t m, n, k;
  int64_t a, a_scale, b, b_scale, out;
  int64_t a_row, b_row, out_row;
};

// grouped_gemm's placement: rows of a and out grouped by expert, each expert's own weight b[g].
struct RowGrouped {
  using Footprint = int64_t;  // rows
  int64_t n, k;

  __device__ Footprint footprint(int64_t count) const { return count; }
  __device__ GroupEntry entry(int64_t g, int64_t count, Footprint r0) const {
    const int64_t kb = k / 128, nb = n / 128;
    return {count, n, k, r0 * k, r0 * kb, g * n * k, g * nb * kb, r0 * n, k, k, n};
  }
};

// wgrad_gemm's placement: the reduction dimension (tokens) grouped, columns of the transposed operands a [m, ...]
// and b [n, ...] 16-aligned per group, scales in per-group [rows, blocks] blocks, one output matrix per group.
struct KGrouped {
  struct Footprint {  // trivially constructible (a __shared__ array holds them); T{} is zero
    int64_t columns, blocks;
    __device__ Footprint operator+(const Footprint& o) const { return {columns + o.columns, blocks + o.blocks}; }
  };
  int64_t m, n, columns;

  __device__ Footprint footprint(int64_t count) const {
    return {(count + 15) / 16 * 16, (count + 127) / 128};
  }
  __device__ GroupEntry entry(int64_t g, int64_t count, Footprint at) const {
    return {count > 0 ? m : 0, n, count, at.columns, m * at.blocks, at.columns, n * at.blocks, g * m * n,
            columns, columns, n};
  }
};

// Exclusive prefix sum of each thread's `mine` over the block's threads (all kTableThreads call it).
template <class T>
__device__ T exclusive_sum(T mine) {
  __shared__ T sums[kTableThreads];
  const int tid = static_cast<int>(threadIdx.x);
  sums[tid] = mine;
  __syncthreads();
  for (int step = 1; step < kTableThreads; step *= 2) {
    const T add = tid >= step ? sums[tid - step] : T{};
    __syncthreads();
    sums[tid] = sums[tid] + add;
    __syncthreads();
  }
  const T before = tid > 0 ? sums[tid - 1] : T{};
  __syncthreads();  // the next call may reuse `sums`
  return before;
}

template <class G, class Layout>
__global__ void __launch_bounds__(kTableThreads)
    write_group_tables(GroupTables<G> t, GroupCounts in, Operands base, Layout layout) {
  const int64_t per = (in.groups + kTableThreads - 1) / kTableThreads;
  const int64_t first = static_cast<int64_t>(threadIdx.x) * per;
  const int64_t last = first + per < in.groups ? first + per : in.groups;
  const auto unclipped = [&](int64_t g) { return static_cast<int64_t>(max(in.counts[g], 0)); };
  const auto clipped = [&](int64_t g, int64_t before) {
    const int64_t start = before < in.bound ? before : in.bound;
    return unclipped(g) < in.bound - start ? unclipped(g) : in.bound - start;
  };

  int64_t items = 0;
  for (int64_t g = first; g < last; ++g) items += unclipped(g);
  const int64_t items_before = exclusive_sum(items);

  typename Layout::Footprint mine{};
  int64_t before = items_before;
  for (int64_t g = first; g < last; ++g) {
    mine = mine + layout.footprint(clipped(g, before));
    before += unclipped(g);
  }
  typename Layout::Footprint at = exclusive_sum(mine);

  before = items_before;
  for (int64_t g = first; g < last; ++g) {
    const int64_t count = clipped(g, before);
    before += unclipped(g);
    const GroupEntry e = layout.entry(g, count, at);
    at = at + layout.footprint(count);

    t.shapes[g] = cute::make_shape(static_cast<int>(e.m), static_cast<int>(e.n), static_cast<int>(e.k));
    t.a[g] = reinterpret_cast<const typename G::ElementAB*>(base.a) + e.a;
    t.b[g] = reinterpret_cast<const typename G::ElementAB*>(base.b) + e.b;
    t.out[g] = reinterpret_cast<typename G::ElementD*>(base.out) + e.out;
    t.a_scale[g] = reinterpret_cast<const float*>(base.a_scale) + e.a_scale;
    t.b_scale[g] = reinterpret_cast<const float*>(base.b_scale) + e.b_scale;
    t.stride_a[g] = G::row_stride_a(e.a_row);
    t.stride_b[g] = G::row_stride_b(e.b_row);
    t.stride_out[g] = G::row_stride_d(e.out_row);
    const auto mnk = cute::make_shape(static_cast<int>(e.m), static_cast<int>(e.n), static_cast<int>(e.k), 1);
    t.layout_a_scale[g] = G::ScaleConfig::tile_atom_to_shape_SFA(mnk);
    t.layout_b_scale[g] = G::ScaleConfig::tile_atom_to_shape_SFB(mnk);
  }
}

constexpr int kZeroThreads = 256;

// Zeros out[g] (group_elements of G::ElementD each, a whole number of 16-byte vectors; out 16-byte aligned) of
// every group whose table entry has M = 0 (the GEMM writes none of it). Grid (blocks per group, groups), after
// write_group_tables on the same stream; every block of a group with tiles returns at once. 16-byte stores,
// grid-stride.
template <class G>
__global__ void __launch_bounds__(kZeroThreads)
    zero_empty_groups(const typename GroupTables<G>::Shape* shapes, uintptr_t out, int64_t group_elements) {
  const int64_t g = blockIdx.y;
  if (cute::get<0>(shapes[g]) != 0) return;
  uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<typename G::ElementD*>(out) + g * group_elements);
  const int64_t vectors = group_elements * static_cast<int64_t>(sizeof(typename G::ElementD)) / 16;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kZeroThreads + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(gridDim.x) * kZeroThreads)
    dst[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace gemm
}  // namespace moe_ep
