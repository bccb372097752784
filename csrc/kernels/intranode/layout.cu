// get_dispatch_layout: tokens per rank and per expert, and the token -> rank mask, from topk_idx.
//
// Protocol: a single block of kLayoutThreads threads runs layout_counts (dispatch_layout.cuh in this
// folder, shared with the notify kernel, which adds positions and the count exchange); it also writes
// is_token_in_rank. No communication.
#include "kernels/common/launch.cuh"
#include "kernels/intranode/dispatch_layout.cuh"
#include "kernels/intranode/intranode.h"

namespace moe_ep {
namespace intranode {

namespace {

template <int kK>
__global__ void __launch_bounds__(kLayoutThreads, 1)
layout_kernel(const __grid_constant__ LayoutArgs a, int num_topk, int num_experts, int nranks, ErrorState* error) {
  layout_counts<kK>(a, 0, a.num_tokens, num_topk, num_experts, nranks, error);
}

}  // namespace

void launch_layout(const Context& c, const LayoutArgs& a, uintptr_t stream) {
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  const Dims& d = c.dims;
  auto* error = reinterpret_cast<ErrorState*>(c.error);
  if (d.num_topk <= 8)
    layout_kernel<8><<<1, kLayoutThreads, 0, st>>>(a, d.num_topk, d.num_experts, d.nranks, error);
  else
    layout_kernel<kMaxTopk><<<1, kLayoutThreads, 0, st>>>(a, d.num_topk, d.num_experts, d.nranks, error);
  check_launch("moe_ep intranode layout kernel");
}

}  // namespace intranode
}  // namespace moe_ep
