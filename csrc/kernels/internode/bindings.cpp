// Python bindings of the cross-node normal-mode kernels: one InternodeContext per Buffer holds the
// fixed device addresses (internode.h Context) and the host-mapped count mailbox; its methods launch
// the kernels. Tensors travel as device addresses (int), streams as cudaStream_t (int).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/internode/internode.h"
#include "runtime/error_check.h"
#include "runtime/host_mailbox.h"

namespace py = pybind11;

namespace moe_ep {
namespace internode {

namespace {

Dims make_dims(int rank, int nranks, int ranks_per_node, int max_tokens, int hidden, int num_topk, int num_experts,
               int round_tokens) {
  if (nranks < 1 || nranks > kMaxGroupRanks || rank < 0 || rank >= nranks)
    throw std::invalid_argument("InternodeContext: rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                                " (at most " + std::to_string(kMaxGroupRanks) + " ranks)");
  if (ranks_per_node < 1 || ranks_per_node > kMaxLocal || nranks % ranks_per_node != 0)
    throw std::invalid_argument("InternodeContext: ranks_per_node " + std::to_string(ranks_per_node) +
                                " must divide " + std::to_string(nranks) + " and be at most " +
                                std::to_string(kMaxLocal));
  if (num_topk < 1 || num_topk > kMaxTopk)
    throw std::invalid_argument("InternodeContext: num_topk must be in [1, " + std::to_string(kMaxTopk) + "]");
  return Dims{rank, nranks, ranks_per_node, max_tokens, hidden, num_topk, num_experts, round_tokens};
}

class InternodeContext {
 public:
  InternodeContext(int rank, int nranks, int ranks_per_node, int max_tokens, int hidden, int num_topk,
                   int num_experts, int round_tokens, double timeout_s, uintptr_t error, uintptr_t epochs,
                   uintptr_t block_counters, uintptr_t workspace, const std::vector<uintptr_t>& node_peers)
      : host_info_(nranks > 0 ? nranks + num_experts / nranks : 1, "internode host info") {
    ctx_.dims = make_dims(rank, nranks, ranks_per_node, max_tokens, hidden, num_topk, num_experts, round_tokens);
    if (round_tokens < 1 || round_tokens > max_tokens)
      throw std::invalid_argument("InternodeContext: round_tokens must be in [1, max_tokens]");
    if (static_cast<int>(node_peers.size()) != ranks_per_node)
      throw std::invalid_argument("InternodeContext: need one workspace address per rank of this node");
    ctx_.ws = workspace_layout(ctx_.dims);
    ctx_.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
    ctx_.error = error;
    ctx_.epochs = epochs;
    ctx_.block_counters = block_counters;
    ctx_.workspace = workspace;
    for (int j = 0; j < ranks_per_node; ++j) ctx_.node_peers[j] = node_peers[j];
  }

  ~InternodeContext() { close(); }

  void close() { host_info_.close(); }

  void route(uintptr_t topk_idx, int num_tokens, uintptr_t in_rank, uintptr_t pos, uintptr_t in_node,
             uintptr_t tokens_per_rank, uintptr_t tokens_per_expert, uintptr_t stream) const {
    launch_route(ctx_, RouteArgs{topk_idx, num_tokens, in_rank, pos, in_node, tokens_per_rank, tokens_per_expert},
                 stream);
  }

  void notify(uintptr_t tokens_per_rank, uintptr_t tokens_per_expert, int num_tokens, uintptr_t recv_info,
              uintptr_t tokens_per_expert_aligned, int expert_alignment, bool worst_case, uintptr_t stream) const {
    const uintptr_t host = worst_case ? 0 : host_info_.device();
    launch_notify(ctx_,
                  NotifyArgs{tokens_per_rank, tokens_per_expert, num_tokens, recv_info, tokens_per_expert_aligned, host,
                             expert_alignment, worst_case},
                  stream);
  }

  // (rows from each source, received rows per local expert) of the last non-worst-case notify; valid
  // once the host has synchronised with that kernel.
  std::pair<std::vector<int>, std::vector<int>> host_info() const {
    const int nranks = ctx_.dims.nranks;
    return {host_info_.read(0, nranks), host_info_.read(nranks, ctx_.dims.num_experts / nranks)};
  }

  void dispatch(uintptr_t x, uintptr_t x_scales, uintptr_t topk_idx, uintptr_t topk_weights, uintptr_t pos,
                uintptr_t in_node, uintptr_t recv_info, int num_tokens, int row_bytes, int num_scales, uintptr_t out_x,
                uintptr_t out_scales, uintptr_t out_topk_idx, uintptr_t out_topk_weights, uintptr_t out_src_rank,
                uintptr_t out_src_index, uintptr_t forward_mask, uintptr_t own_row, bool cached, int num_blocks,
                uintptr_t stream) const {
    DispatchArgs a{};
    a.x = x;
    a.x_scales = x_scales;
    a.topk_idx = topk_idx;
    a.topk_weights = topk_weights;
    a.pos = pos;
    a.in_node = in_node;
    a.recv_info = recv_info;
    a.num_tokens = num_tokens;
    a.row_bytes = row_bytes;
    a.num_scales = num_scales;
    a.out_x = out_x;
    a.out_scales = out_scales;
    a.out_topk_idx = out_topk_idx;
    a.out_topk_weights = out_topk_weights;
    a.out_src_rank = out_src_rank;
    a.out_src_index = out_src_index;
    a.forward_mask = forward_mask;
    a.own_row = own_row;
    a.cached = cached;
    a.num_blocks = num_blocks < kMaxChannels ? num_blocks : kMaxChannels;
    launch_dispatch(ctx_, a, stream);
  }

  void combine(uintptr_t x, uintptr_t src_index, uintptr_t recv_info, uintptr_t forward_mask, uintptr_t own_row,
               uintptr_t in_node, int num_tokens, uintptr_t out, bool with_weights, uintptr_t topk_weights,
               uintptr_t out_topk_weights, int num_blocks, uintptr_t stream) const {
    launch_combine(ctx_,
                   CombineArgs{x, src_index, recv_info, forward_mask, own_row, in_node, num_tokens, out, with_weights,
                               topk_weights, out_topk_weights, num_blocks < kMaxChannels ? num_blocks : kMaxChannels},
                   stream);
  }

  int round_tokens() const { return ctx_.dims.round_tokens; }
  uint64_t data_offset() const { return ctx_.ws.counts; }

 private:
  Context ctx_{};
  HostMailbox host_info_;  // [R] rows per source, then [E_l] rows per local expert
};

// Round size and workspace bytes of a Buffer: the largest round whose workspace fits the budget.
std::pair<int, uint64_t> plan(int nranks, int ranks_per_node, int max_tokens, int hidden, int num_topk,
                              int num_experts, uint64_t budget_bytes) {
  Dims d = make_dims(0, nranks, ranks_per_node, max_tokens, hidden, num_topk, num_experts, 1);
  d.round_tokens = choose_round_tokens(d, budget_bytes);
  return {d.round_tokens, workspace_layout(d).total};
}

}  // namespace

}  // namespace internode
}  // namespace moe_ep

void register_internode(py::module_& m) {
  using moe_ep::internode::InternodeContext;
  m.attr("INTERNODE_MAX_RANKS") = moe_ep::internode::kMaxGroupRanks;
  m.attr("INTERNODE_MAX_RANKS_PER_NODE") = moe_ep::internode::kMaxLocal;
  m.attr("INTERNODE_MAX_CHANNELS") = moe_ep::internode::kMaxChannels;
  m.attr("INTERNODE_NUM_EPOCHS") = moe_ep::internode::kEpochCounters;
  m.attr("INTERNODE_ROW_META_BYTES") = static_cast<int>(sizeof(moe_ep::internode::RowMeta));
  m.def("internode_plan", &moe_ep::internode::plan, py::arg("nranks"), py::arg("ranks_per_node"),
        py::arg("max_tokens"), py::arg("hidden"), py::arg("num_topk"), py::arg("num_experts"), py::arg("budget_bytes"),
        "(round_tokens, workspace_bytes): the largest round of token slots (at most max_tokens) whose "
        "cross-node workspace fits "
        "budget_bytes (kernels/internode/internode.h), and that workspace's size.");
  py::class_<InternodeContext>(m, "InternodeContext",
                               "Fixed device addresses of one Buffer's cross-node normal-mode kernels, and their "
                               "launchers.")
      .def(py::init<int, int, int, int, int, int, int, int, double, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                    const std::vector<uintptr_t>&>(),
           py::arg("rank"), py::arg("nranks"), py::arg("ranks_per_node"), py::arg("max_tokens"), py::arg("hidden"),
           py::arg("num_topk"), py::arg("num_experts"), py::arg("round_tokens"), py::arg("timeout_s"),
           py::arg("error"), py::arg("epochs"), py::arg("block_counters"), py::arg("workspace"),
           py::arg("node_peers"))
      .def("close", &InternodeContext::close, "Free the host-mapped count mailbox.")
      .def("route", &InternodeContext::route,
           "Launch the routing kernel: is_token_in_rank, positions, nodes, tokens per rank and expert.")
      .def("notify", &InternodeContext::notify, "Launch the count exchange; fills recv_info.")
      .def("host_info", &InternodeContext::host_info,
           "(rows per source, rows per local expert) written by the last non-worst-case notify.")
      .def("dispatch", &InternodeContext::dispatch, "Launch the cross-node dispatch kernel.")
      .def("combine", &InternodeContext::combine,
           "Launch the cross-node combine kernel (with_weights: topk_weights travel with the rows, their sums go to "
           "out_topk_weights).")
      .def_property_readonly("round_tokens", &InternodeContext::round_tokens, "Token slots per round (C).")
      .def_property_readonly("data_offset", &InternodeContext::data_offset,
                             "Workspace offset where the data areas start (the signal words lie before it).");
}
