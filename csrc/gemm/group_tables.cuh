// The per-group tables CUTLASS's grouped GEMM reads (problem shape, operand and scale addresses, strides, scale
// layouts, one entry per expert), carved out of the caller's workspace and written on the device from the
// expert counts, so the host never learns the group sizes (no synchronisation).
//
// Protocol (one block of kThreads, on the GEMM's stream before it): thread t owns the groups
// [t * per, (t + 1) * per), per = ceil(groups / kThreads). Each thread sums its groups' counts (negative
// counts count as 0), the block turns the kThreads sums into exclusive prefix sums in shared memory
// (Hillis-Steele, log2(kThreads) steps), and each thread then walks its groups again: group g starts at row
// r0 = the rows before it and gets m = min(count, rows - r0) rows (never past `rows`, so a bad count cannot
// make the GEMM write past `out`). Its entries:
//   shape  (m, n, k)                      a    a + r0 * k         a_scale  a_scale + r0 * k / 128
//   b      b + g * n * k                  b_scale  b_scale + g * (n / 128) * (k / 128)
//   out    out + r0 * n                   strides: a and b rows k elements apart, out rows n apart
//   scale layouts: Gemm::ScaleConfig's K-major layouts for (m, n, k) (row p's K/128 scales contiguous).
// A group with m = 0 has no tiles; CUTLASS's group scheduler skips it and reads none of its entries.
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

// What the table kernel reads besides the tables.
struct TableInputs {
  const int32_t* counts;
  uintptr_t a, a_scale, b, b_scale, out;
  int64_t rows, n, k, groups;
};

template <class G>
__global__ void __launch_bounds__(kTableThreads) write_group_tables(GroupTables<G> t, TableInputs in) {
  __shared__ int64_t before[kTableThreads];  // rows of the groups of threads < t, once scanned
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t per = (in.groups + kTableThreads - 1) / kTableThreads;
  const int64_t first = tid * per;
  const int64_t last = first + per < in.groups ? first + per : in.groups;

  int64_t mine = 0;
  for (int64_t g = first; g < last; ++g) mine += max(in.counts[g], 0);
  before[tid] = mine;
  __syncthreads();
  for (int step = 1; step < kTableThreads; step *= 2) {
    const int64_t add = tid >= step ? before[tid - step] : 0;
    __syncthreads();
    before[tid] += add;
    __syncthreads();
  }
  int64_t r0 = before[tid] - mine;  // inclusive scan minus this thread's own rows

  const int64_t n = in.n, k = in.k, kb = k / 128, nb = n / 128;
  for (int64_t g = first; g < last; ++g) {
    const int64_t start = r0 < in.rows ? r0 : in.rows;
    const int64_t count = max(in.counts[g], 0);
    const int64_t m = count < in.rows - start ? count : in.rows - start;
    r0 += count;

    t.shapes[g] = cute::make_shape(static_cast<int>(m), static_cast<int>(n), static_cast<int>(k));
    t.a[g] = reinterpret_cast<const typename G::ElementAB*>(in.a) + start * k;
    t.b[g] = reinterpret_cast<const typename G::ElementAB*>(in.b) + g * n * k;
    t.out[g] = reinterpret_cast<typename G::ElementD*>(in.out) + start * n;
    t.a_scale[g] = reinterpret_cast<const float*>(in.a_scale) + start * kb;
    t.b_scale[g] = reinterpret_cast<const float*>(in.b_scale) + g * nb * kb;
    t.stride_a[g] = G::row_stride_a(k);
    t.stride_b[g] = G::row_stride_b(k);
    t.stride_out[g] = G::row_stride_d(n);
    const auto mnk = cute::make_shape(static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1);
    t.layout_a_scale[g] = G::ScaleConfig::tile_atom_to_shape_SFA(mnk);
    t.layout_b_scale[g] = G::ScaleConfig::tile_atom_to_shape_SFB(mnk);
  }
}

}  // namespace gemm
}  // namespace moe_ep
