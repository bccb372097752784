// Python bindings of the low-latency kernels: a LowLatencyContext holds everything fixed for one
// Buffer (ranks, node size, dims, region addresses, offsets), so each call passes only its tensors'
// addresses.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/low_latency/low_latency.h"

namespace py = pybind11;
using moe_ep::ll::LowLatencyParams;

namespace {

LowLatencyParams make_params(int rank, int nranks, int ranks_per_node, int num_local_experts, int num_topk, int hidden,
                             int max_tokens, double timeout_s, uintptr_t error, uintptr_t epochs, uintptr_t masked,
                             uintptr_t sym,
                             const std::vector<uintptr_t>& node_sym, uint64_t dispatch_payload_offset,
                             uint64_t dispatch_meta_offset, uint64_t combine_payload_offset,
                             uint64_t combine_scratch_offset, uint64_t signals_offset, uintptr_t done_counters,
                             uintptr_t combine_stash, int blocks_per_expert, int num_sms) {
  using moe_ep::ll::kMaxNodeRanks;
  if (ranks_per_node < 1 || ranks_per_node > kMaxNodeRanks || nranks < 1 || nranks % ranks_per_node != 0)
    throw std::invalid_argument("LowLatencyContext: ranks_per_node must be in [1, " + std::to_string(kMaxNodeRanks) +
                                "] and divide nranks, got " + std::to_string(ranks_per_node) + " of " +
                                std::to_string(nranks));
  if (static_cast<long long>(num_local_experts) * nranks > 32767)
    throw std::invalid_argument("LowLatencyContext: expert ids travel as int16, so at most 32767 experts, got " +
                                std::to_string(static_cast<long long>(num_local_experts) * nranks));
  if (static_cast<int>(node_sym.size()) != ranks_per_node)
    throw std::invalid_argument("LowLatencyContext: node_sym needs one address per rank of the node");
  for (int i = 0; i < ranks_per_node; ++i)
    if (node_sym[i] == 0)
      throw std::invalid_argument("LowLatencyContext: rank " + std::to_string(rank - rank % ranks_per_node + i) +
                                  " of this rank's node is not reachable by NVLink loads/stores (nvshmem_ptr is 0)");
  LowLatencyParams p{};
  p.rank = rank;
  p.nranks = nranks;
  p.ranks_per_node = ranks_per_node;
  p.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
  p.error = error;
  p.epochs = epochs;
  p.masked = masked;
  p.num_local_experts = num_local_experts;
  p.num_topk = num_topk;
  p.hidden = hidden;
  p.max_tokens = max_tokens;
  p.sym = sym;
  for (int i = 0; i < ranks_per_node; ++i) p.node_sym[i] = node_sym[i];
  p.dispatch_payload_offset = dispatch_payload_offset;
  p.dispatch_meta_offset = dispatch_meta_offset;
  p.combine_payload_offset = combine_payload_offset;
  p.combine_scratch_offset = combine_scratch_offset;
  p.signals_offset = signals_offset;
  p.done_counters = done_counters;
  p.combine_stash = combine_stash;
  p.blocks_per_expert = blocks_per_expert;
  p.num_sms = num_sms;
  return p;
}

}  // namespace

void register_low_latency(py::module_& m) {
  m.def(
      "ll_region_layout",
      [](int nranks, int max_tokens, int hidden, int num_topk, int scratch_blocks) {
        if (nranks < 1 || max_tokens < 1 || hidden < 1 || num_topk < 1 || scratch_blocks < 0)
          throw std::invalid_argument("ll_region_layout: sizes must be positive (scratch_blocks >= 0)");
        const auto l = moe_ep::ll::region_layout(nranks, max_tokens, hidden, num_topk, scratch_blocks);
        py::dict d;
        d["dispatch_payload"] = l.dispatch_payload;
        d["dispatch_meta"] = l.dispatch_meta;
        d["combine_payload"] = l.combine_payload;
        d["combine_scratch"] = l.combine_scratch;
        d["signals"] = l.signals;
        d["total"] = l.total;
        return d;
      },
      py::arg("nranks"), py::arg("max_tokens"), py::arg("hidden"), py::arg("num_topk"), py::arg("scratch_blocks"),
      "Byte offsets of the low-latency symmetric region's areas and its size (kernels/low_latency/low_latency.h).");
  m.attr("LL_META_BYTES") = moe_ep::ll::kMetaBytes;
  m.attr("LL_SCRATCH_ROWS") = moe_ep::ll::kScratchRows;
  m.attr("LL_NUM_SIGNALS") = moe_ep::ll::kNumSignals;
  py::class_<LowLatencyParams>(m, "LowLatencyContext",
                               "Fixed state of one Buffer's low-latency kernels (addresses are device pointers).")
      .def(py::init(&make_params), py::kw_only(), py::arg("rank"), py::arg("nranks"), py::arg("ranks_per_node"),
           py::arg("num_local_experts"), py::arg("num_topk"), py::arg("hidden"), py::arg("max_tokens"),
           py::arg("timeout_s"), py::arg("error"), py::arg("epochs"), py::arg("masked"), py::arg("sym"),
           py::arg("node_sym"),
           py::arg("dispatch_payload_offset"), py::arg("dispatch_meta_offset"), py::arg("combine_payload_offset"),
           py::arg("combine_scratch_offset"), py::arg("signals_offset"), py::arg("done_counters"),
           py::arg("combine_stash"), py::arg("blocks_per_expert"), py::arg("num_sms"))
      .def("dispatch", &moe_ep::ll::launch_dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("num_tokens"),
           py::arg("recv_x"), py::arg("recv_scales"), py::arg("src_rank"), py::arg("src_index"), py::arg("src_k"),
           py::arg("count"), py::arg("use_fp8"), py::arg("round_scale"), py::arg("send"), py::arg("receive"),
           py::arg("stream"),
           "The dispatch kernel's send half (push each token to the ranks of its experts) and/or receive half "
           "(wait for every rank, expand staged tokens into expert-major rows).")
      .def("combine", &moe_ep::ll::launch_combine, py::arg("y"), py::arg("src_rank"), py::arg("src_index"),
           py::arg("src_k"), py::arg("count"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("num_tokens"),
           py::arg("out"), py::arg("send"), py::arg("receive"), py::arg("stream"),
           "The combine kernel's send half (push expert outputs back to their tokens' ranks) and/or receive "
           "half (wait for every rank, reduce each token's rows in ascending k into out).");
}
