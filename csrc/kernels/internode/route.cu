// Cross-node routing of one call: for every token, the ranks and nodes it goes to, its position among
// this rank's tokens for each rank, and the token counts per rank and per expert (the inputs of
// notify and dispatch). Works for any R (the NVLink layout kernel stops at 8 ranks).
//
// Protocol: no communication. The launcher zeroes in_node and tokens_per_expert on the stream; then one
// block of 1024 threads per destination rank r walks the tokens in tiles of 1024, thread i taking
// token tile + i: it reads the token's K expert ids and sets `hit` when one lives on r (expert e is
// on rank e / E_l), adding 1 to tokens_per_expert of each of r's experts at its first occurrence in
// the row (integer atomics: the totals do not depend on their order). in_rank[t][r] = hit, in_node[t]
// [r / L] = true when hit (several blocks may store the same true). A block-wide exclusive scan of
// `hit` (common/scan.cuh block_exclusive_scan) plus the running total of earlier tiles gives
// pos[t][r] (-1 when not hit); the final total is tokens_per_rank[r]. A barrier ends every tile, so
// the scan's shared array is reused safely from tile to tile.
#include "kernels/common/launch.cuh"
#include "kernels/common/scan.cuh"
#include "kernels/internode/internode.h"

namespace moe_ep {
namespace internode {

namespace {

__global__ void __launch_bounds__(kThreads, 1)
route_kernel(const __grid_constant__ DeviceContext ctx, const __grid_constant__ RouteArgs a) {
  __shared__ int warp_sums[32];
  const int tid = threadIdx.x, r = blockIdx.x;
  const int R = ctx.dims.nranks, K = ctx.dims.num_topk, E_l = ctx.dims.num_local_experts(), Nn = ctx.nodes();
  const auto* topk = reinterpret_cast<const long long*>(a.topk_idx);
  auto* in_rank = reinterpret_cast<bool*>(a.in_rank);
  auto* in_node = reinterpret_cast<bool*>(a.in_node);
  auto* pos = reinterpret_cast<int*>(a.pos);
  auto* per_expert = reinterpret_cast<int*>(a.tokens_per_expert);
  int carry = 0;  // tokens of earlier tiles that go to r (block-uniform)
  for (int tile = 0; tile < a.num_tokens; tile += kThreads) {
    const int t = tile + tid;
    bool hit = false;
    if (t < a.num_tokens) {
      int ids[kMaxTopk];
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k)
        ids[k] = k < K ? checked_expert(ctx.comm.error, __ldg(topk + (size_t)t * K + k), ctx.dims.num_experts, t, k) : -1;
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) {
        if (k >= K || ids[k] < r * E_l || ids[k] >= (r + 1) * E_l) continue;
        hit = true;
        bool first = true;
#pragma unroll
        for (int j = 0; j < kMaxTopk; ++j) first &= !(j < k && ids[j] == ids[k]);
        if (first) atomicAdd(per_expert + ids[k], 1);
      }
      in_rank[(size_t)t * R + r] = hit;
      if (hit) in_node[(size_t)t * Nn + r / ctx.dims.local] = true;
    }
    int total;
    const int before = carry + block_exclusive_scan(hit ? 1 : 0, warp_sums, &total);
    if (t < a.num_tokens) pos[(size_t)t * R + r] = hit ? before : -1;
    carry += total;
    __syncthreads();  // warp_sums is free for the next tile's scan
  }
  if (tid == 0) reinterpret_cast<int*>(a.tokens_per_rank)[r] = carry;
}

}  // namespace

void launch_route(const Context& c, const RouteArgs& a, uintptr_t stream) {
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  check_cuda(cudaMemsetAsync(reinterpret_cast<void*>(a.in_node), 0, (size_t)a.num_tokens * c.dims.nodes(), st),
             "cudaMemsetAsync(in_node)");
  check_cuda(cudaMemsetAsync(reinterpret_cast<void*>(a.tokens_per_expert), 0, sizeof(int) * c.dims.num_experts, st),
             "cudaMemsetAsync(tokens_per_expert)");
  route_kernel<<<c.dims.nranks, kThreads, 0, st>>>(make_device_context(c), a);
  check_launch("moe_ep internode route kernel");
}

}  // namespace internode
}  // namespace moe_ep
