// Python bindings of the cross-node normal-mode kernels: one InternodeContext per Buffer holds the
// fixed device addresses (internode.h Context) and the host-mapped count mailbox; its methods launch
// the kernels. Tensors travel as device addresses (int), streams as cudaStream_t (int).
//
// Each launcher takes one argument struct (internode.h RouteArgs, NotifyArgs, DispatchArgs,
// CombineArgs), bound as InternodeRouteArgs, ... with keyword-only constructors, and the stream:
// ctx.dispatch(InternodeDispatchArgs(x=..., ...), stream). It checks the struct first (check below,
// also callable as args.check(InternodeDims(...)) without a GPU): ValueError naming the launcher and
// the field.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/normal_args.h"
#include "kernels/internode/internode.h"
#include "runtime/error_check.h"
#include "runtime/host_mailbox.h"
#include "runtime/named_args.h"

namespace py = pybind11;

namespace moe_ep {
namespace internode {

namespace {

// The Buffer's dimensions, checked (the context's constructor and plan); `where` names the caller.
Dims make_dims(const char* where, int rank, int nranks, int ranks_per_node, int max_tokens, int hidden, int num_topk,
               int num_experts, int round_tokens) {
  const ArgCheck c(where);
  check_normal_dims(c, rank, nranks, kMaxGroupRanks, max_tokens, hidden, num_topk, kMaxTopk, num_experts);
  if (ranks_per_node < 1 || ranks_per_node > kMaxNodeRanks || nranks % ranks_per_node != 0)
    c.fail("ranks_per_node " + std::to_string(ranks_per_node) + " must divide " + std::to_string(nranks) +
           " and be at most " + std::to_string(kMaxNodeRanks));
  c.in_range("round_tokens", round_tokens, 1, max_tokens);
  return Dims{rank, nranks, ranks_per_node, max_tokens, hidden, num_topk, num_experts, round_tokens};
}

// Every address the context holds, checked (none may be 0).
Context make_context(const Dims& dims, const RuntimeContext& rt, uintptr_t epochs, uintptr_t block_counters,
                     uintptr_t workspace, const std::vector<uintptr_t>& node_peers) {
  const ArgCheck c("InternodeContext");
  if (static_cast<int>(node_peers.size()) != dims.local)
    c.fail("need one workspace address per rank of this node");
  Context ctx = normal_context<Context>(c, dims, rt, epochs, block_counters);
  c.pointer("workspace", workspace);
  ctx.workspace = workspace;
  for (int j = 0; j < dims.local; ++j) {
    if (node_peers[j] == 0) c.fail("node_peers[" + std::to_string(j) + "] is null");
    ctx.node_peers[j] = node_peers[j];
  }
  return ctx;
}

// ---- The launchers' checks (check(dims, args), also bound as InternodeXxxArgs.check) ----
void check(const Dims& d, const RouteArgs& a) {
  const ArgCheck c("InternodeContext.route");
  c.count("num_tokens", a.num_tokens, "max_tokens", d.max_tokens);
  const bool in = a.num_tokens > 0;
  c.pointer("topk_idx", a.topk_idx, in);
  c.pointer("in_rank", a.in_rank, in);
  c.pointer("pos", a.pos, in);
  c.pointer("in_node", a.in_node, in);
  c.pointer("tokens_per_rank", a.tokens_per_rank);
  c.pointer("tokens_per_expert", a.tokens_per_expert);
}

void check(const Dims& d, const NotifyArgs& a) {
  const ArgCheck c("InternodeContext.notify");
  c.pointer("tokens_per_rank", a.tokens_per_rank);
  c.pointer("tokens_per_expert", a.tokens_per_expert);
  c.count("num_tokens", a.num_tokens, "max_tokens", d.max_tokens);
  c.pointer("recv_info", a.recv_info);
  c.pointer("tokens_per_expert_aligned", a.tokens_per_expert_aligned);
  c.at_least("expert_alignment", a.expert_alignment, 1);
}

void check(const Dims& d, const DispatchArgs& a) {
  const ArgCheck c("InternodeContext.dispatch");
  check_normal_dispatch(c, d, a);
  c.in_range("num_blocks", a.num_blocks, 1, kMaxChannels);  // one block per channel
  c.pointer("in_node", a.in_node, a.num_tokens > 0);
  c.pointer("forward_mask", a.forward_mask, !a.cached);
  c.pointer("own_row", a.own_row, !a.cached);
  const long long rows = static_cast<long long>(d.nranks) * d.max_tokens;
  if (a.worst_case && a.num_rows != rows)
    c.fail("num_rows = " + std::to_string(a.num_rows) + " in worst-case mode, expected nranks * max_tokens = " +
           std::to_string(rows));
}

void check(const Dims& d, const CombineArgs& a) {
  const ArgCheck c("InternodeContext.combine");
  check_normal_combine(c, d, a);
  c.in_range("num_blocks", a.num_blocks, 1, kMaxChannels);
  c.pointer("forward_mask", a.forward_mask);
  c.pointer("own_row", a.own_row);
  c.pointer("in_node", a.in_node, a.num_tokens > 0);
}

class InternodeContext {
 public:
  // Every argument is checked before anything is allocated (ValueError naming the field).
  InternodeContext(const RuntimeContext& rt, int ranks_per_node, int max_tokens, int hidden, int num_topk,
                   int num_experts, int round_tokens, uintptr_t epochs, uintptr_t block_counters, uintptr_t workspace,
                   const std::vector<uintptr_t>& node_peers)
      : ctx_(make_context(make_dims("InternodeContext", rt.rank, rt.nranks, ranks_per_node, max_tokens, hidden,
                                    num_topk, num_experts, round_tokens),
                          rt, epochs, block_counters, workspace, node_peers)),
        host_info_(rt.nranks + num_experts / rt.nranks + rt.nranks * kStampWords, "internode host info") {}

  ~InternodeContext() { close(); }

  void close() { host_info_.close(); }

  const Dims& dims() const { return ctx_.dims; }

  // Each launcher checks its arguments first (check above: ValueError naming the field).
  void route(const RouteArgs& a, uintptr_t stream) const {
    check(ctx_.dims, a);
    launch_route(ctx_, a, stream);
  }

  void notify(const NotifyArgs& args, uintptr_t stream, const std::vector<int>& stamp) const {
    check(ctx_.dims, args);
    if (stamp.size() > static_cast<size_t>(kStampWords))
      ArgCheck("InternodeContext.notify").fail("stamp has " + std::to_string(stamp.size()) + " words, at most " +
                                         std::to_string(kStampWords));
    NotifyArgs a = args;
    a.host_info = a.worst_case ? 0 : host_info_.device();
    for (int w = 0; w < kStampWords; ++w) a.stamp[w] = w < static_cast<int>(stamp.size()) ? stamp[w] : 0;
    launch_notify(ctx_, a, stream);
  }

  // (rows from each source, received rows per local expert) of the last non-worst-case notify; valid
  // once the host has synchronised with that kernel.
  std::pair<std::vector<int>, std::vector<int>> host_info() const {
    const int nranks = ctx_.dims.nranks;
    return {host_info_.read(0, nranks), host_info_.read(nranks, ctx_.dims.num_experts / nranks)};
  }

  // Every rank's call stamp ([R][kStampWords], call_stamp.h) as the last non-worst-case notify received
  // them; valid once the host has synchronised with that kernel.
  std::vector<int> host_stamps() const {
    const int nranks = ctx_.dims.nranks;
    return host_info_.read(nranks + ctx_.dims.num_experts / nranks, nranks * kStampWords);
  }

  // num_blocks is the number of channels, at most kMaxChannels (checked: nothing is capped silently).
  void dispatch(const DispatchArgs& a, uintptr_t stream) const {
    check(ctx_.dims, a);
    launch_dispatch(ctx_, a, stream);
  }

  void combine(const CombineArgs& a, uintptr_t stream) const {
    check(ctx_.dims, a);
    launch_combine(ctx_, a, stream);
  }

  int round_tokens() const { return ctx_.dims.round_tokens; }
  uint64_t data_offset() const { return ctx_.ws.counts; }

 private:
  Context ctx_{};          // first: its checks run before host_info_ allocates
  HostMailbox host_info_;  // [R] rows per source, then [E_l] rows per local expert, then [R][kStampWords]
};

// Round size and workspace bytes of a Buffer: the largest round whose workspace fits the budget.
std::pair<int, uint64_t> plan(int nranks, int ranks_per_node, int max_tokens, int hidden, int num_topk,
                              int num_experts, uint64_t budget_bytes) {
  Dims d = make_dims("internode_plan", 0, nranks, ranks_per_node, max_tokens, hidden, num_topk, num_experts, 1);
  d.round_tokens = choose_round_tokens(d, budget_bytes);
  return {d.round_tokens, workspace_layout(d).total};
}

}  // namespace

}  // namespace internode
}  // namespace moe_ep

void register_internode(py::module_& m) {
  namespace inter = moe_ep::internode;
  namespace na = moe_ep::named_args;
  using inter::InternodeContext;
  m.attr("INTERNODE_MAX_RANKS") = inter::kMaxGroupRanks;
  m.attr("INTERNODE_MAX_CHANNELS") = inter::kMaxChannels;
  m.attr("INTERNODE_NUM_EPOCHS") = inter::kEpochCounters;
  m.attr("INTERNODE_ROW_META_BYTES") = static_cast<int>(sizeof(inter::RowMeta));
  m.def("internode_plan", &inter::plan, py::arg("nranks"), py::arg("ranks_per_node"), py::arg("max_tokens"),
        py::arg("hidden"), py::arg("num_topk"), py::arg("num_experts"), py::arg("budget_bytes"),
        "(round_tokens, workspace_bytes): the largest round of token slots (at most max_tokens) whose "
        "cross-node workspace fits "
        "budget_bytes (kernels/internode/internode.h), and that workspace's size.");

  using D = inter::Dims;
  na::bind_args<D>(m, "InternodeDims", "The fixed dimensions of one Buffer's cross-node kernels (internode.h Dims).",
                   na::required("rank", &D::rank), na::required("nranks", &D::nranks),
                   na::required("ranks_per_node", &D::local), na::required("max_tokens", &D::max_tokens),
                   na::required("hidden", &D::hidden), na::required("num_topk", &D::num_topk),
                   na::required("num_experts", &D::num_experts), na::required("round_tokens", &D::round_tokens));
  using RA = inter::RouteArgs;
  auto route = na::bind_args<RA>(
      m, "InternodeRouteArgs", "Arguments of InternodeContext.route (internode.h RouteArgs).",
      na::required("topk_idx", &RA::topk_idx), na::required("num_tokens", &RA::num_tokens),
      na::required("in_rank", &RA::in_rank), na::required("pos", &RA::pos), na::required("in_node", &RA::in_node),
      na::required("tokens_per_rank", &RA::tokens_per_rank), na::required("tokens_per_expert", &RA::tokens_per_expert));
  na::def_check<D>(route, &inter::check);
  using NA = inter::NotifyArgs;
  auto notify = na::bind_args<NA>(
      m, "InternodeNotifyArgs",
      "Arguments of InternodeContext.notify (internode.h NotifyArgs; host_info is the context's mailbox).",
      na::required("tokens_per_rank", &NA::tokens_per_rank), na::required("tokens_per_expert", &NA::tokens_per_expert),
      na::required("num_tokens", &NA::num_tokens), na::required("recv_info", &NA::recv_info),
      na::required("tokens_per_expert_aligned", &NA::tokens_per_expert_aligned),
      na::required("expert_alignment", &NA::expert_alignment), na::required("worst_case", &NA::worst_case));
  na::def_check<D>(notify, &inter::check);
  using DA = inter::DispatchArgs;
  auto dispatch = na::bind_args<DA>(
      m, "InternodeDispatchArgs", "Arguments of InternodeContext.dispatch (internode.h DispatchArgs).",
      na::required("x", &DA::x), na::optional("x_scales", &DA::x_scales), na::optional("topk_idx", &DA::topk_idx),
      na::optional("topk_weights", &DA::topk_weights), na::required("pos", &DA::pos),
      na::required("in_node", &DA::in_node), na::required("recv_info", &DA::recv_info),
      na::required("num_tokens", &DA::num_tokens), na::required("row_bytes", &DA::row_bytes),
      na::required("num_scales", &DA::num_scales), na::required("num_rows", &DA::num_rows),
      na::required("out_x", &DA::out_x), na::optional("out_scales", &DA::out_scales),
      na::optional("out_topk_idx", &DA::out_topk_idx), na::optional("out_topk_weights", &DA::out_topk_weights),
      na::optional("out_src_rank", &DA::out_src_rank), na::optional("out_src_index", &DA::out_src_index),
      na::required("forward_mask", &DA::forward_mask), na::required("own_row", &DA::own_row),
      na::required("worst_case", &DA::worst_case), na::required("cached", &DA::cached),
      na::required("num_blocks", &DA::num_blocks));
  na::def_check<D>(dispatch, &inter::check);
  using CA = inter::CombineArgs;
  auto combine = na::bind_args<CA>(
      m, "InternodeCombineArgs", "Arguments of InternodeContext.combine (internode.h CombineArgs).",
      na::required("x", &CA::x), na::required("src_index", &CA::src_index), na::required("recv_info", &CA::recv_info),
      na::required("forward_mask", &CA::forward_mask), na::required("own_row", &CA::own_row),
      na::required("in_node", &CA::in_node), na::required("num_tokens", &CA::num_tokens),
      na::required("num_rows", &CA::num_rows), na::required("out", &CA::out),
      na::required("with_weights", &CA::with_weights), na::optional("topk_weights", &CA::topk_weights),
      na::optional("out_topk_weights", &CA::out_topk_weights), na::required("num_blocks", &CA::num_blocks));
  na::def_check<D>(combine, &inter::check);

  py::class_<InternodeContext>(m, "InternodeContext",
                               "Fixed device addresses of one Buffer's cross-node normal-mode kernels, and their "
                               "launchers.")
      .def(py::init<const moe_ep::RuntimeContext&, int, int, int, int, int, int, uintptr_t, uintptr_t, uintptr_t,
                    const std::vector<uintptr_t>&>(),
           py::kw_only(), py::arg("runtime"), py::arg("ranks_per_node"), py::arg("max_tokens"), py::arg("hidden"),
           py::arg("num_topk"), py::arg("num_experts"), py::arg("round_tokens"), py::arg("epochs"),
           py::arg("block_counters"), py::arg("workspace"), py::arg("node_peers"),
           "Checks every argument (ValueError naming it: a size out of range, a null address) before it "
           "allocates the host-mapped count mailbox.")
      .def_property_readonly("dims", &InternodeContext::dims, "The Buffer's InternodeDims.")
      .def("close", &InternodeContext::close, "Free the host-mapped count mailbox.")
      .def("route", &InternodeContext::route, py::arg("args"), py::arg("stream"),
           "Check an InternodeRouteArgs and launch the routing kernel: is_token_in_rank, positions, nodes, tokens "
           "per rank and expert.")
      .def("notify", &InternodeContext::notify, py::arg("args"), py::arg("stream"), py::arg("stamp") = std::vector<int>{},
           "Check an InternodeNotifyArgs and launch the count exchange; fills recv_info.")
      .def("host_stamps", &InternodeContext::host_stamps,
           "Every rank's call stamp (R * kStampWords int32) received by the last non-worst-case notify.")
      .def("host_info", &InternodeContext::host_info,
           "(rows per source, rows per local expert) written by the last non-worst-case notify.")
      .def("dispatch", &InternodeContext::dispatch, py::arg("args"), py::arg("stream"),
           "Check an InternodeDispatchArgs and launch the cross-node dispatch kernel (at most "
           "INTERNODE_MAX_CHANNELS blocks).")
      .def("combine", &InternodeContext::combine, py::arg("args"), py::arg("stream"),
           "Check an InternodeCombineArgs and launch the cross-node combine kernel (with_weights: topk_weights "
           "travel with the rows, their sums go to out_topk_weights).")
      .def_property_readonly("round_tokens", &InternodeContext::round_tokens, "Token slots per round (C).")
      .def_property_readonly("data_offset", &InternodeContext::data_offset,
                             "Workspace offset where the data areas start (the signal words lie before it).");
}
