// get_dispatch_layout: tokens per rank and per expert, and the token -> rank mask, from topk_idx.
//
// Protocol: a single block of kLayoutThreads threads runs layout_counts and layout_positions
// (kernels/intranode.h, shared with the notify kernel, which fuses them with the count exchange); no
// communication.
#include "kernels/intranode.h"

namespace moe_ep {
namespace intranode {

namespace {

__global__ void __launch_bounds__(kLayoutThreads, 1)
layout_kernel(const __grid_constant__ LayoutArgs a, int num_topk, int num_experts, int nranks) {
  layout_counts(a, num_topk, num_experts, nranks);
  layout_positions(a, num_topk, num_experts, nranks);
}

}  // namespace

void launch_layout(const Context& c, const LayoutArgs& a, uintptr_t stream) {
  layout_kernel<<<1, kLayoutThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(a, c.dims.num_topk,
                                                                                  c.dims.num_experts, c.dims.nranks);
  check_launch("moe_ep intranode layout kernel");
}

}  // namespace intranode
}  // namespace moe_ep
