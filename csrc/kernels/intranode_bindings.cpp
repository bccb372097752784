// Python bindings of the intranode (normal-mode) kernels: one IntranodeContext per Buffer holds the
// fixed device addresses (kernels/intranode.h Context) and the host-mapped count mailbox; its methods
// launch the kernels. Tensors travel as device addresses (int), streams as cudaStream_t (int).
//
// Run-time tuning of the dispatch / combine kernels (intranode.h Tuning), read once per process, the
// first time a context is made. Results are identical for every setting; only speed changes. Ranks
// may differ (the protocol does not depend on it).
//   MOE_EP_SEND_WARPS  = 1..32  dispatch: warps per 32-warp block that send first; the rest receive
//                               from the start. Default 24.
//   MOE_EP_COMBINE_SEND_WARPS = 1..32  combine: the same, the rest reduce from the start. Default 16
//                               (measured on 2xH200, 2026-11-30, against 24: 419.5 / 232.2 / 220.5 vs
//                               431.4 / 242.7 / 228.1 us at 8 / 24 / 32 SMs).
//   MOE_EP_UNROLL      = 4 | 6  int4 loads in flight per lane in every row copy (6 is the most the
//                               dispatch kernel holds in its 64 registers without spilling). Default 6.
//   MOE_EP_FLAG_BATCH  = 1..32  row flags a sending warp raises per system fence (dispatch: one per
//                               peer destination of a token; combine: one per row). Default 4.
//   MOE_EP_RECV_RUN    = 1..32  dispatch: consecutive positions of one source per receive work item
//                               (copied as one span); combine: tokens per reduce work item. Default 1
//                               (measured on 2xH200, 2026-11-30: combine 252 vs 340 us at 32 SMs
//                               against 8; dispatch within run-to-run noise).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/intranode.h"
#include "runtime/error_check.h"
#include "runtime/host_mailbox.h"

namespace py = pybind11;

namespace moe_ep {
namespace intranode {

namespace {

// Integer environment variable `name` in [lo, hi], or `fallback` when unset or empty.
int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long value = std::strtol(v, &end, 10);
  if (*end != '\0' || value < lo || value > hi)
    throw std::invalid_argument(std::string(name) + "=" + v + ": expected an integer in " + std::to_string(lo) +
                                ".." + std::to_string(hi));
  return static_cast<int>(value);
}

Tuning read_tuning() {
  Tuning t{};
  t.send_warps = env_int("MOE_EP_SEND_WARPS", 24, 1, kHostWarps);
  t.combine_send_warps = env_int("MOE_EP_COMBINE_SEND_WARPS", 16, 1, kHostWarps);
  t.unroll = env_int("MOE_EP_UNROLL", 6, 4, 6);
  if (t.unroll != 4 && t.unroll != 6)
    throw std::invalid_argument("MOE_EP_UNROLL=" + std::to_string(t.unroll) + ": expected 4 or 6");
  t.flag_batch = env_int("MOE_EP_FLAG_BATCH", 4, 1, 32);
  t.recv_run = env_int("MOE_EP_RECV_RUN", 1, 1, 32);
  return t;
}

// The process-wide tuning, read on first use.
const Tuning& tuning() {
  static const Tuning t = read_tuning();
  return t;
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
    ctx_.tuning = tuning();
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

  py::dict tuning_dict() const {
    py::dict d;
    d["send_warps"] = ctx_.tuning.send_warps;
    d["combine_send_warps"] = ctx_.tuning.combine_send_warps;
    d["unroll"] = ctx_.tuning.unroll;
    d["flag_batch"] = ctx_.tuning.flag_batch;
    d["recv_run"] = ctx_.tuning.recv_run;
    return d;
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
  m.attr("NUM_EPOCHS") = moe_ep::intranode::kEpochCounters;
  m.def("intranode_workspace_bytes", &moe_ep::intranode::workspace_bytes, py::arg("nranks"), py::arg("max_tokens"),
        py::arg("hidden"), py::arg("num_topk"), py::arg("num_experts"),
        "Bytes of the symmetric workspace one normal-mode Buffer needs (kernels/intranode.h).");
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
      .def_property_readonly("tuning", &IntranodeContext::tuning_dict,
                             "Kernel tuning in use (MOE_EP_SEND_WARPS, _COMBINE_SEND_WARPS, _UNROLL, _FLAG_BATCH, _RECV_RUN).");
}
