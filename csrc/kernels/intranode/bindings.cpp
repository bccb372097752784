// Python bindings of the intranode (normal-mode) kernels: one IntranodeContext per Buffer holds the
// fixed device addresses (intranode.h Context, in this folder) and the host-mapped count mailbox;
// its methods launch the kernels. Tensors travel as device addresses (int), streams as cudaStream_t
// (int).
//
// Each launcher takes one argument struct (intranode.h LayoutArgs, NotifyArgs, DispatchArgs,
// CombineArgs, ExpandArgs), bound as IntranodeLayoutArgs, ... with keyword-only constructors, and the stream:
// ctx.dispatch(IntranodeDispatchArgs(x=..., ...), stream). It checks the struct first (check below,
// also callable as args.check(IntranodeDims(...)) without a GPU): ValueError naming the launcher and
// the field.
//
// The kernels' tuning (intranode.h Tuning) comes from moe_ep.Config (moe_ep/comm/config.py documents each
// knob, its default and the environment variable that may set that default) through set_tuning,
// which checks every field here. Results are identical for every setting; only speed changes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/normal_args.h"
#include "kernels/intranode/intranode.h"
#include "runtime/error_check.h"
#include "runtime/host_mailbox.h"
#include "runtime/named_args.h"

namespace py = pybind11;

namespace moe_ep {
namespace intranode {

namespace {

// `value` of the tuning field `name` when it lies in [lo, hi]; std::invalid_argument naming it otherwise.
int checked_knob(const char* name, int value, int lo, int hi) {
  if (value < lo || value > hi)
    throw std::invalid_argument(std::string("tuning: ") + name + " = " + std::to_string(value) +
                                ", expected an integer in " + std::to_string(lo) + ".." + std::to_string(hi));
  return value;
}

// The Buffer's dimensions, checked (the context's constructor).
Dims make_dims(int rank, int nranks, int max_tokens, int hidden, int num_topk, int num_experts) {
  check_normal_dims(ArgCheck("IntranodeContext"), rank, nranks, kMaxNodeRanks, max_tokens, hidden, num_topk, kMaxTopk,
                    num_experts);
  return Dims{rank, nranks, max_tokens, hidden, num_topk, num_experts};
}

// Every address the context holds, checked (none may be 0).
Context make_context(const Dims& dims, const RuntimeContext& rt, uintptr_t epochs, uintptr_t block_counters,
                     uintptr_t layout_scratch, const std::vector<uintptr_t>& signals,
                     const std::vector<uintptr_t>& workspace, const std::vector<uintptr_t>& row_flags) {
  const ArgCheck c("IntranodeContext");
  const int nranks = dims.nranks;
  if (static_cast<int>(signals.size()) != nranks || static_cast<int>(workspace.size()) != nranks ||
      static_cast<int>(row_flags.size()) != nranks)
    c.fail("need one signal, workspace and row-flag address per rank");
  Context ctx = normal_context<Context>(c, dims, rt, epochs, block_counters);
  c.pointer("layout_scratch", layout_scratch);
  ctx.layout_scratch = layout_scratch;
  const auto peers = [&](const char* name, const std::vector<uintptr_t>& list, uintptr_t* to) {
    for (int r = 0; r < nranks; ++r) {
      if (list[r] == 0) c.fail(std::string(name) + "[" + std::to_string(r) + "] is null");
      to[r] = list[r];
    }
  };
  peers("signals", signals, ctx.signals);
  peers("workspace", workspace, ctx.workspace);
  peers("row_flags", row_flags, ctx.row_flags);
  return ctx;
}

// ---- The launchers' checks (check(dims, args), also bound as IntranodeXxxArgs.check) ----
void check(const Dims& d, const LayoutArgs& a) {
  const ArgCheck c("IntranodeContext.layout");
  c.count("num_tokens", a.num_tokens, "max_tokens", d.max_tokens);
  const bool in = a.num_tokens > 0;
  c.pointer("topk_idx", a.topk_idx, in);
  c.pointer("tokens_per_rank", a.tokens_per_rank);
  c.pointer("tokens_per_expert", a.tokens_per_expert);
  c.pointer("is_token_in_rank", a.is_token_in_rank, in);
}

void check(const Dims& d, const NotifyArgs& a) {
  const ArgCheck c("IntranodeContext.notify");
  c.count("num_tokens", a.num_tokens, "max_tokens", d.max_tokens);
  c.at_least("expert_alignment", a.expert_alignment, 1);
  const bool in = a.num_tokens > 0;
  c.pointer("topk_idx", a.topk_idx, in);
  c.pointer("is_token_in_rank", a.is_token_in_rank, in);
  c.pointer("pos", a.pos, in);
  c.pointer("recv_info", a.recv_info);
  c.pointer("tokens_per_expert", a.tokens_per_expert);
}

void check(const Dims& d, const DispatchArgs& a) {
  const ArgCheck c("IntranodeContext.dispatch");
  check_normal_dispatch(c, d, a, !a.expert_major);
  if (a.expert_major && a.out_x != 0) c.fail("out_x must be 0 with expert_major (expand copies the rows)");
  const long long rows = static_cast<long long>(d.nranks) * d.max_tokens;
  if (a.worst_case && a.num_rows != rows)
    c.fail("num_rows = " + std::to_string(a.num_rows) + " in worst-case mode, expected nranks * max_tokens = " +
           std::to_string(rows));
}

void check(const Dims& d, const CombineArgs& a) {
  const ArgCheck c("IntranodeContext.combine");
  check_normal_combine(c, d, a);
  c.pointer("src_rank", a.src_rank, a.num_rows > 0);
  c.pointer("is_token_in_rank", a.is_token_in_rank, a.num_tokens > 0);
  c.pointer("pos", a.pos, a.num_tokens > 0);
}

void check(const Dims& d, const ExpandArgs& a) {
  const ArgCheck c("IntranodeContext.expand");
  const long long max_rows = static_cast<long long>(d.nranks) * d.max_tokens;
  c.count("num_rows", a.num_rows, "nranks * max_tokens", max_rows);
  c.at_least("expert_alignment", a.expert_alignment, 1);
  const long long local_experts = d.num_experts / d.nranks;  // every pair the layout of max_rows rows can hold
  c.count("num_pairs", a.num_pairs, "nranks * max_tokens * min(num_topk, local experts) + (expert_alignment - 1) * "
          "local experts", max_rows * std::min<long long>(d.num_topk, local_experts) +
          (a.expert_alignment - 1LL) * local_experts);
  check_row_format(c, d.hidden, a.row_bytes, a.num_scales);
  c.at_least("num_blocks", a.num_blocks, 1);
  const bool out = a.num_pairs > 0, fp8 = a.num_scales > 0;
  c.pointer("rows", a.rows, out);
  c.pointer("src_rank", a.src_rank, out && a.num_rows > 0);
  c.pointer("recv_info", a.recv_info);
  c.pointer("scales", a.scales, out && fp8 && a.num_rows > 0);
  c.pointer("out_x", a.out_x, out);
  c.pointer("out_scales", a.out_scales, out && fp8);
}

class IntranodeContext {
 public:
  // Every argument is checked before anything is allocated (ValueError naming the field).
  IntranodeContext(const RuntimeContext& rt, int max_tokens, int hidden, int num_topk, int num_experts,
                   uintptr_t epochs, uintptr_t block_counters, uintptr_t layout_scratch,
                   const std::vector<uintptr_t>& signals, const std::vector<uintptr_t>& workspace,
                   const std::vector<uintptr_t>& row_flags)
      : ctx_(make_context(make_dims(rt.rank, rt.nranks, max_tokens, hidden, num_topk, num_experts), rt, epochs,
                          block_counters, layout_scratch, signals, workspace, row_flags)),
        host_info_(rt.nranks + num_experts / rt.nranks + rt.nranks * kStampWords, "intranode host info") {}

  ~IntranodeContext() { close(); }

  void close() { host_info_.close(); }

  const Dims& dims() const { return ctx_.dims; }

  // Each launcher checks its arguments first (check above: ValueError naming the field).
  void layout(const LayoutArgs& a, uintptr_t stream) const {
    check(ctx_.dims, a);
    launch_layout(ctx_, a, stream);
  }

  void notify(const NotifyArgs& args, uintptr_t stream, const std::vector<int>& stamp) const {
    check(ctx_.dims, args);
    if (stamp.size() > static_cast<size_t>(kStampWords))
      ArgCheck("IntranodeContext.notify").fail("stamp has " + std::to_string(stamp.size()) + " words, at most " +
                                         std::to_string(kStampWords));
    NotifyArgs a = args;
    a.host_info = a.worst_case ? 0 : host_info_.device();
    for (int w = 0; w < kStampWords; ++w) a.stamp[w] = w < static_cast<int>(stamp.size()) ? stamp[w] : 0;
    launch_notify(ctx_, a, stream);
  }

  // The tuning of the next dispatch / combine launches (every field checked, named in the error).
  void set_tuning(int send_warps, int combine_send_warps, int unroll, int flag_batch, int recv_run) {
    Tuning t{};
    t.send_warps = checked_knob("send_warps", send_warps, 1, kHostWarps);
    t.combine_send_warps = checked_knob("combine_send_warps", combine_send_warps, 1, kHostWarps);
    if (unroll < 0 || unroll > 30 || !((kUnrollValues >> unroll) & 1)) {
      std::string allowed;  // the values of kUnrollValues, in words
      for (int u = 0; u <= 30; ++u)
        if ((kUnrollValues >> u) & 1) allowed += (allowed.empty() ? "" : ", ") + std::to_string(u);
      throw std::invalid_argument("tuning: unroll = " + std::to_string(unroll) + ", expected one of " + allowed +
                                  " (kUnrollValues)");
    }
    t.unroll = unroll;
    t.flag_batch = checked_knob("flag_batch", flag_batch, 1, 32);
    t.recv_run = checked_knob("recv_run", recv_run, 1, 32);
    ctx_.tuning = t;
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

  void dispatch(const DispatchArgs& a, uintptr_t stream) const {
    check(ctx_.dims, a);
    launch_dispatch(ctx_, a, stream);
  }

  void combine(const CombineArgs& a, uintptr_t stream) const {
    check(ctx_.dims, a);
    launch_combine(ctx_, a, stream);
  }

  void expand(const ExpandArgs& a, uintptr_t stream) const {
    check(ctx_.dims, a);
    launch_expand(ctx_, a, stream);
  }

 private:
  Context ctx_{};          // first: its checks run before host_info_ allocates
  HostMailbox host_info_;  // [R] rows per source, then [E_l] rows per local expert, then [R][kStampWords]
};

uint64_t workspace_bytes(int nranks, int max_tokens, int hidden, int num_topk, int num_experts) {
  return workspace_layout(Dims{0, nranks, max_tokens, hidden, num_topk, num_experts}).total;
}

}  // namespace

}  // namespace intranode
}  // namespace moe_ep

void register_intranode(py::module_& m) {
  namespace intra = moe_ep::intranode;
  namespace na = moe_ep::named_args;
  using intra::IntranodeContext;
  m.attr("SIGNAL_WORDS") = intra::kSignalWords;
  m.attr("STAMP_WORDS") = moe_ep::kStampWords;
  m.attr("TUNING_MAX_WARPS") = intra::kHostWarps;
  m.attr("TUNING_UNROLL_MASK") = intra::kUnrollValues;
  m.attr("NUM_EPOCHS") = intra::kHostNumEpochs;
  m.def("intranode_workspace_bytes", &intra::workspace_bytes, py::arg("nranks"), py::arg("max_tokens"),
        py::arg("hidden"), py::arg("num_topk"), py::arg("num_experts"),
        "Bytes of the symmetric workspace one normal-mode Buffer needs (kernels/intranode/intranode.h).");
  m.attr("INTRANODE_BLOCK_COUNTERS") = static_cast<int>(intra::kBlockCounters);
  m.def("intranode_layout_scratch_words", &intra::layout_scratch_words, py::arg("nranks"), py::arg("num_experts"),
        "int32 words of the device scratch of the notify kernel's layout (intranode.h; zeroed at allocation).");

  using D = intra::Dims;
  na::bind_args<D>(m, "IntranodeDims", "The fixed dimensions of one Buffer's normal-mode kernels (intranode.h Dims).",
                   na::required("rank", &D::rank), na::required("nranks", &D::nranks),
                   na::required("max_tokens", &D::max_tokens), na::required("hidden", &D::hidden),
                   na::required("num_topk", &D::num_topk), na::required("num_experts", &D::num_experts));
  using LA = intra::LayoutArgs;
  auto layout = na::bind_args<LA>(
      m, "IntranodeLayoutArgs", "Arguments of IntranodeContext.layout (intranode.h LayoutArgs).",
      na::required("topk_idx", &LA::topk_idx), na::required("num_tokens", &LA::num_tokens),
      na::required("tokens_per_rank", &LA::tokens_per_rank), na::required("tokens_per_expert", &LA::tokens_per_expert),
      na::required("is_token_in_rank", &LA::is_token_in_rank), na::optional("pos", &LA::pos));
  na::def_check<D>(layout, &intra::check);
  using NA = intra::NotifyArgs;
  auto notify = na::bind_args<NA>(
      m, "IntranodeNotifyArgs",
      "Arguments of IntranodeContext.notify (intranode.h NotifyArgs; host_info is the context's mailbox).",
      na::required("topk_idx", &NA::topk_idx), na::required("num_tokens", &NA::num_tokens),
      na::required("is_token_in_rank", &NA::is_token_in_rank), na::required("pos", &NA::pos),
      na::required("recv_info", &NA::recv_info), na::required("tokens_per_expert", &NA::tokens_per_expert),
      na::required("expert_alignment", &NA::expert_alignment), na::required("worst_case", &NA::worst_case));
  na::def_check<D>(notify, &intra::check);
  using DA = intra::DispatchArgs;
  auto dispatch = na::bind_args<DA>(
      m, "IntranodeDispatchArgs", "Arguments of IntranodeContext.dispatch (intranode.h DispatchArgs).",
      na::required("x", &DA::x), na::optional("x_scales", &DA::x_scales), na::optional("topk_idx", &DA::topk_idx),
      na::optional("topk_weights", &DA::topk_weights), na::required("pos", &DA::pos),
      na::required("recv_info", &DA::recv_info), na::required("num_tokens", &DA::num_tokens),
      na::required("row_bytes", &DA::row_bytes), na::required("num_scales", &DA::num_scales),
      na::required("num_rows", &DA::num_rows), na::optional("out_x", &DA::out_x),
      na::optional("out_scales", &DA::out_scales), na::optional("out_topk_idx", &DA::out_topk_idx),
      na::optional("out_topk_weights", &DA::out_topk_weights), na::optional("out_src_rank", &DA::out_src_rank),
      na::optional("out_src_index", &DA::out_src_index), na::required("worst_case", &DA::worst_case),
      na::required("cached", &DA::cached), na::optional("expert_major", &DA::expert_major),
      na::required("num_blocks", &DA::num_blocks));
  na::def_check<D>(dispatch, &intra::check);
  using CA = intra::CombineArgs;
  auto combine = na::bind_args<CA>(
      m, "IntranodeCombineArgs", "Arguments of IntranodeContext.combine (intranode.h CombineArgs).",
      na::required("x", &CA::x), na::required("num_rows", &CA::num_rows), na::required("src_rank", &CA::src_rank),
      na::required("src_index", &CA::src_index), na::required("is_token_in_rank", &CA::is_token_in_rank),
      na::required("pos", &CA::pos), na::required("recv_info", &CA::recv_info),
      na::required("num_tokens", &CA::num_tokens), na::required("out", &CA::out),
      na::required("with_weights", &CA::with_weights), na::optional("topk_weights", &CA::topk_weights),
      na::optional("out_topk_weights", &CA::out_topk_weights), na::required("num_blocks", &CA::num_blocks));
  na::def_check<D>(combine, &intra::check);
  using EA = intra::ExpandArgs;
  auto expand = na::bind_args<EA>(
      m, "IntranodeExpandArgs", "Arguments of IntranodeContext.expand (intranode.h ExpandArgs).",
      na::required("rows", &EA::rows), na::required("num_pairs", &EA::num_pairs),
      na::required("num_rows", &EA::num_rows), na::required("expert_alignment", &EA::expert_alignment),
      na::required("src_rank", &EA::src_rank),
      na::required("recv_info", &EA::recv_info), na::required("row_bytes", &EA::row_bytes),
      na::required("num_scales", &EA::num_scales), na::optional("scales", &EA::scales),
      na::required("out_x", &EA::out_x), na::optional("out_scales", &EA::out_scales),
      na::required("num_blocks", &EA::num_blocks));
  na::def_check<D>(expand, &intra::check);

  py::class_<IntranodeContext>(m, "IntranodeContext",
                               "Fixed device addresses of one Buffer's normal-mode kernels, and their launchers.")
      .def(py::init<const moe_ep::RuntimeContext&, int, int, int, int, uintptr_t, uintptr_t, uintptr_t,
                    const std::vector<uintptr_t>&, const std::vector<uintptr_t>&, const std::vector<uintptr_t>&>(),
           py::kw_only(), py::arg("runtime"), py::arg("max_tokens"), py::arg("hidden"), py::arg("num_topk"),
           py::arg("num_experts"), py::arg("epochs"), py::arg("block_counters"), py::arg("layout_scratch"), py::arg("signals"), py::arg("workspace"),
           py::arg("row_flags"),
           "Checks every argument (ValueError naming it: a size out of range, a null address) before it "
           "allocates the host-mapped count mailbox.")
      .def_property_readonly("dims", &IntranodeContext::dims, "The Buffer's IntranodeDims.")
      .def("close", &IntranodeContext::close, "Free the host-mapped count mailbox.")
      .def("layout", &IntranodeContext::layout, py::arg("args"), py::arg("stream"),
           "Check an IntranodeLayoutArgs and launch the layout kernel (get_dispatch_layout).")
      .def("notify", &IntranodeContext::notify, py::arg("args"), py::arg("stream"), py::arg("stamp") = std::vector<int>{},
           "Check an IntranodeNotifyArgs and launch layout + count exchange (start of a dispatch); fills pos, "
           "recv_info, tokens_per_expert.")
      .def("host_stamps", &IntranodeContext::host_stamps,
           "Every rank's call stamp (R * kStampWords int32) received by the last non-worst-case notify.")
      .def("host_info", &IntranodeContext::host_info,
           "(rows per source, rows per local expert) written by the last non-worst-case notify.")
      .def("dispatch", &IntranodeContext::dispatch, py::arg("args"), py::arg("stream"),
           "Check an IntranodeDispatchArgs and launch the dispatch kernel.")
      .def("combine", &IntranodeContext::combine, py::arg("args"), py::arg("stream"),
           "Check an IntranodeCombineArgs and launch the combine kernel (with_weights: topk_weights travel "
           "with the rows, their sums go to out_topk_weights).")
      .def("expand", &IntranodeContext::expand, py::arg("args"), py::arg("stream"),
           "Check an IntranodeExpandArgs and launch the expand kernel: the rows an expert_major dispatch "
           "left in the workspace, copied out as expert-major pairs (launch it next on the dispatch's stream).")
      .def("set_tuning", &IntranodeContext::set_tuning, py::arg("send_warps"), py::arg("combine_send_warps"),
           py::arg("unroll"), py::arg("flag_batch"), py::arg("recv_run"),
           "Tuning of the next dispatch / combine launches (moe_ep.Config; each field checked).");
}
