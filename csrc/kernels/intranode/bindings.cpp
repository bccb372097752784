// Python bindings of the intranode (normal-mode) kernels: one IntranodeContext per Buffer holds the
// fixed device addresses (intranode.h Context, in this folder) and the host-mapped count mailbox;
// its methods launch the kernels. Tensors travel as device addresses (int), streams as cudaStream_t
// (int).
//
// The kernels' tuning (intranode.h Tuning) comes from moe_ep.Config (moe_ep/config.py documents each
// knob, its default and the environment variable that may set that default) through set_tuning,
// which checks every field here. Results are identical for every setting; only speed changes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/intranode/intranode.h"
#include "runtime/error_check.h"
#include "runtime/host_mailbox.h"

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

class IntranodeContext {
 public:
  IntranodeContext(int rank, int nranks, int max_tokens, int hidden, int num_topk, int num_experts, double timeout_s,
                   uintptr_t error, uintptr_t epochs, uintptr_t block_counters, uintptr_t layout_scratch,
                   const std::vector<uintptr_t>& signals, const std::vector<uintptr_t>& workspace,
                   const std::vector<uintptr_t>& row_flags)
      : host_info_(nranks > 0 ? nranks + num_experts / nranks : 1, "intranode host info") {
    if (nranks < 1 || nranks > kMaxPeers || rank < 0 || rank >= nranks)
      throw std::invalid_argument("IntranodeContext: rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                                  " (at most " + std::to_string(kMaxPeers) + " ranks)");
    if (static_cast<int>(signals.size()) != nranks || static_cast<int>(workspace.size()) != nranks ||
        static_cast<int>(row_flags.size()) != nranks)
      throw std::invalid_argument("IntranodeContext: need one signal, workspace and row-flag address per rank");
    ctx_.dims = Dims{rank, nranks, max_tokens, hidden, num_topk, num_experts};
    ctx_.ws = workspace_layout(ctx_.dims);
    ctx_.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
    ctx_.error = error;
    ctx_.epochs = epochs;
    ctx_.block_counters = block_counters;
    ctx_.layout_scratch = layout_scratch;
    for (int r = 0; r < nranks; ++r) {
      ctx_.signals[r] = signals[r];
      ctx_.workspace[r] = workspace[r];
      ctx_.row_flags[r] = row_flags[r];
    }
  }

  ~IntranodeContext() { close(); }

  void close() { host_info_.close(); }

  void layout(uintptr_t topk_idx, int num_tokens, uintptr_t tokens_per_rank, uintptr_t tokens_per_expert,
              uintptr_t is_token_in_rank, uintptr_t stream) const {
    launch_layout(ctx_, LayoutArgs{topk_idx, num_tokens, tokens_per_rank, tokens_per_expert, is_token_in_rank, 0},
                  stream);
  }

  void notify(uintptr_t topk_idx, int num_tokens, uintptr_t is_token_in_rank, uintptr_t pos, uintptr_t recv_info,
              uintptr_t tokens_per_expert, int expert_alignment, bool worst_case, uintptr_t stream) const {
    const uintptr_t host = worst_case ? 0 : host_info_.device();
    launch_notify(ctx_,
                  NotifyArgs{topk_idx, num_tokens, is_token_in_rank, pos, recv_info, tokens_per_expert, host,
                             expert_alignment, worst_case},
                  stream);
  }

  // The tuning of the next dispatch / combine launches (every field checked, named in the error).
  void set_tuning(int send_warps, int combine_send_warps, int unroll, int flag_batch, int recv_run) {
    Tuning t{};
    t.send_warps = checked_knob("send_warps", send_warps, 1, kHostWarps);
    t.combine_send_warps = checked_knob("combine_send_warps", combine_send_warps, 1, kHostWarps);
    t.unroll = checked_knob("unroll", unroll, 4, 6);
    if (t.unroll == 5) throw std::invalid_argument("tuning: unroll = 5, expected 4 or 6");
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

  void dispatch(uintptr_t x, uintptr_t x_scales, uintptr_t topk_idx, uintptr_t topk_weights, uintptr_t pos,
                uintptr_t recv_info, int num_tokens, int row_bytes, int num_scales, uintptr_t out_x,
                uintptr_t out_scales, uintptr_t out_topk_idx, uintptr_t out_topk_weights, uintptr_t out_src_rank,
                uintptr_t out_src_index, bool worst_case, bool cached, int num_blocks, uintptr_t stream) const {
    DispatchArgs a{};
    a.x = x;
    a.x_scales = x_scales;
    a.topk_idx = topk_idx;
    a.topk_weights = topk_weights;
    a.pos = pos;
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
    a.worst_case = worst_case;
    a.cached = cached;
    a.num_blocks = num_blocks;
    launch_dispatch(ctx_, a, stream);
  }

  void combine(uintptr_t x, int num_rows, uintptr_t src_rank, uintptr_t src_index, uintptr_t is_token_in_rank,
               uintptr_t pos, uintptr_t recv_info, int num_tokens, uintptr_t out, bool with_weights,
               uintptr_t topk_weights, uintptr_t out_topk_weights, int num_blocks, uintptr_t stream) const {
    launch_combine(ctx_,
                   CombineArgs{x, num_rows, src_rank, src_index, is_token_in_rank, pos, recv_info, num_tokens, out,
                               with_weights, topk_weights, out_topk_weights, num_blocks},
                   stream);
  }

 private:
  Context ctx_{};
  HostMailbox host_info_;  // [R] rows per source, then [E_l] rows per local expert
};

uint64_t workspace_bytes(int nranks, int max_tokens, int hidden, int num_topk, int num_experts) {
  return workspace_layout(Dims{0, nranks, max_tokens, hidden, num_topk, num_experts}).total;
}

}  // namespace

}  // namespace intranode
}  // namespace moe_ep

void register_intranode(py::module_& m) {
  using moe_ep::intranode::IntranodeContext;
  m.attr("SIGNAL_WORDS") = moe_ep::intranode::kSignalWords;
  m.attr("MAX_TOPK") = moe_ep::intranode::kMaxTopk;
  m.attr("TUNING_MAX_WARPS") = moe_ep::intranode::kHostWarps;
  m.attr("NUM_EPOCHS") = moe_ep::intranode::kHostNumEpochs;
  m.def("intranode_workspace_bytes", &moe_ep::intranode::workspace_bytes, py::arg("nranks"), py::arg("max_tokens"),
        py::arg("hidden"), py::arg("num_topk"), py::arg("num_experts"),
        "Bytes of the symmetric workspace one normal-mode Buffer needs (kernels/intranode/intranode.h).");
  py::class_<IntranodeContext>(m, "IntranodeContext",
                               "Fixed device addresses of one Buffer's normal-mode kernels, and their launchers.")
      .def(py::init<int, int, int, int, int, int, double, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                    const std::vector<uintptr_t>&, const std::vector<uintptr_t>&, const std::vector<uintptr_t>&>(),
           py::arg("rank"), py::arg("nranks"), py::arg("max_tokens"), py::arg("hidden"), py::arg("num_topk"),
           py::arg("num_experts"), py::arg("timeout_s"), py::arg("error"), py::arg("epochs"),
           py::arg("block_counters"), py::arg("layout_scratch"), py::arg("signals"), py::arg("workspace"),
           py::arg("row_flags"))
      .def("close", &IntranodeContext::close, "Free the host-mapped count mailbox.")
      .def("layout", &IntranodeContext::layout, "Launch the layout kernel (get_dispatch_layout).")
      .def("notify", &IntranodeContext::notify,
           "Launch layout + count exchange (start of a dispatch); fills pos, recv_info, tokens_per_expert.")
      .def("host_info", &IntranodeContext::host_info,
           "(rows per source, rows per local expert) written by the last non-worst-case notify.")
      .def("dispatch", &IntranodeContext::dispatch, "Launch the dispatch kernel.")
      .def("combine", &IntranodeContext::combine,
           "Launch the combine kernel (with_weights: topk_weights travel with the rows, their sums go to "
           "out_topk_weights).")
      .def("set_tuning", &IntranodeContext::set_tuning, py::arg("send_warps"), py::arg("combine_send_warps"),
           py::arg("unroll"), py::arg("flag_batch"), py::arg("recv_run"),
           "Tuning of the next dispatch / combine launches (moe_ep.Config; each field checked).");
}
