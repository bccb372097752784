// Python bindings of the low-latency kernels: a LowLatencyContext holds everything fixed for one
// Buffer (ranks, dims, peer addresses, offsets), so each call passes only its tensors' addresses.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/low_latency.h"

namespace py = pybind11;
using moe_ep::ll::LowLatencyParams;

namespace {

LowLatencyParams make_params(int rank, int nranks, int num_local_experts, int num_topk, int hidden, int max_tokens,
                             double timeout_s, uintptr_t error, uintptr_t epochs, const std::vector<uintptr_t>& signals,
                             const std::vector<uintptr_t>& sym, uint64_t dispatch_payload_offset,
                             uint64_t dispatch_meta_offset, uint64_t combine_payload_offset, uintptr_t done_counters,
                             uintptr_t combine_stash, int blocks_per_expert) {
  if (nranks < 1 || nranks > moe_ep::ll::kMaxPeers)
    throw std::invalid_argument("LowLatencyContext: nranks must be in [1, " + std::to_string(moe_ep::ll::kMaxPeers) +
                                "], got " + std::to_string(nranks));
  if (static_cast<int>(signals.size()) != nranks || static_cast<int>(sym.size()) != nranks)
    throw std::invalid_argument("LowLatencyContext: signals and sym need one address per rank");
  LowLatencyParams p{};
  p.rank = rank;
  p.nranks = nranks;
  p.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
  p.error = error;
  p.epochs = epochs;
  for (int r = 0; r < nranks; ++r) {
    p.signals[r] = signals[r];
    p.sym[r] = sym[r];
  }
  p.num_local_experts = num_local_experts;
  p.num_topk = num_topk;
  p.hidden = hidden;
  p.max_tokens = max_tokens;
  p.dispatch_payload_offset = dispatch_payload_offset;
  p.dispatch_meta_offset = dispatch_meta_offset;
  p.combine_payload_offset = combine_payload_offset;
  p.done_counters = done_counters;
  p.combine_stash = combine_stash;
  p.blocks_per_expert = blocks_per_expert;
  return p;
}

}  // namespace

void register_low_latency(py::module_& m) {
  py::class_<LowLatencyParams>(m, "LowLatencyContext",
                               "Fixed state of one Buffer's low-latency kernels (addresses are device pointers).")
      .def(py::init(&make_params), py::kw_only(), py::arg("rank"), py::arg("nranks"), py::arg("num_local_experts"),
           py::arg("num_topk"), py::arg("hidden"), py::arg("max_tokens"), py::arg("timeout_s"), py::arg("error"),
           py::arg("epochs"), py::arg("signals"), py::arg("sym"), py::arg("dispatch_payload_offset"),
           py::arg("dispatch_meta_offset"), py::arg("combine_payload_offset"), py::arg("done_counters"),
           py::arg("combine_stash"), py::arg("blocks_per_expert"))
      .def("dispatch_send", &moe_ep::ll::dispatch_send, py::arg("x"), py::arg("topk_idx"), py::arg("num_tokens"),
           py::arg("use_fp8"), py::arg("round_scale"), py::arg("stream"),
           "Quantise (optionally) and push each token to the ranks of its experts; release the flags.")
      .def("dispatch_recv", &moe_ep::ll::dispatch_recv, py::arg("recv_x"), py::arg("recv_scales"),
           py::arg("src_rank"), py::arg("src_index"), py::arg("src_k"), py::arg("count"), py::arg("use_fp8"),
           py::arg("stream"), "Wait for every rank, then expand staged tokens into expert-major rows.")
      .def("combine_send", &moe_ep::ll::combine_send, py::arg("y"), py::arg("src_rank"), py::arg("src_index"),
           py::arg("src_k"), py::arg("count"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("num_tokens"),
           py::arg("stream"), "Push expert outputs back to their tokens' ranks; release the flags.")
      .def("combine_recv", &moe_ep::ll::combine_recv, py::arg("out"), py::arg("num_tokens"), py::arg("stream"),
           "Wait for every rank, then reduce each token's rows in ascending k into out.");
}
