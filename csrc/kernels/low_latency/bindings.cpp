// Python bindings of the low-latency kernels: a LowLatencyContext holds everything fixed for one
// Buffer (ranks, node size, dims, region addresses, offsets), so each call passes only its tensors'
// addresses. Each launcher takes one argument struct (low_latency.h DispatchLaunchArgs,
// CombineLaunchArgs), bound as LowLatencyDispatchArgs and LowLatencyCombineArgs with keyword-only
// constructors, and the stream: ctx.dispatch(LowLatencyDispatchArgs(x=..., ...), stream). It checks the
// struct first (check below, also callable as args.check(LowLatencyDims(...)) without a GPU):
// ValueError naming the launcher and the field.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/low_latency/low_latency.h"
#include "runtime/context.h"
#include "runtime/named_args.h"

namespace py = pybind11;

namespace moe_ep {
namespace ll {

namespace {

// Every field of the context, checked (ValueError naming it); nothing is allocated.
LowLatencyParams make_params(const RuntimeContext& rt, int ranks_per_node, int num_local_experts, int num_topk,
                             int hidden, int max_tokens, uintptr_t epochs, uintptr_t masked, uintptr_t sym,
                             const std::vector<uintptr_t>& node_sym, uint64_t dispatch_payload_offset,
                             uint64_t dispatch_meta_offset, uint64_t combine_payload_offset,
                             uint64_t combine_scratch_offset, uint64_t signals_offset, uintptr_t done_counters,
                             uintptr_t combine_stash, int blocks_per_expert, int num_sms) {
  const ArgCheck c("LowLatencyContext");
  const int rank = rt.rank, nranks = rt.nranks;
  if (ranks_per_node < 1 || ranks_per_node > kMaxNodeRanks || nranks < 1 || nranks % ranks_per_node != 0)
    c.fail("ranks_per_node must be in [1, " + std::to_string(kMaxNodeRanks) + "] and divide nranks, got " +
           std::to_string(ranks_per_node) + " of " + std::to_string(nranks));
  c.at_least("num_local_experts", num_local_experts, 1);
  if (static_cast<long long>(num_local_experts) * nranks > 32767)
    c.fail("expert ids travel as int16, so at most 32767 experts, got " +
           std::to_string(static_cast<long long>(num_local_experts) * nranks));
  c.in_range("num_topk", num_topk, 1, kMaxTopk);
  c.positive_multiple("hidden", hidden, 8);
  c.at_least("max_tokens", max_tokens, 1);
  c.pointer("epochs", epochs);
  c.pointer("sym", sym);
  if (static_cast<int>(node_sym.size()) != ranks_per_node) c.fail("node_sym needs one address per rank of the node");
  for (int i = 0; i < ranks_per_node; ++i)
    if (node_sym[i] == 0)
      c.fail("rank " + std::to_string(rank - rank % ranks_per_node + i) +
             " of this rank's node is not reachable by NVLink loads/stores (nvshmem_ptr is 0)");
  c.pointer("done_counters", done_counters);
  c.pointer("combine_stash", combine_stash);
  c.at_least("blocks_per_expert", blocks_per_expert, 1);
  c.at_least("num_sms", num_sms, 1);
  LowLatencyParams p{};
  p.rank = rank;
  p.nranks = nranks;
  p.ranks_per_node = ranks_per_node;
  p.timeout_ns = rt.timeout_ns;
  p.error = rt.error;
  p.verdict = rt.verdict;
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

// ---- The launchers' checks (check(dims, args), also bound as LowLatencyXxxArgs.check) ----
// A launch runs the send half, the receive half or both; a pointer is needed only by a half it runs.
void check(const Dims& d, const DispatchLaunchArgs& a) {
  const ArgCheck c("LowLatencyContext.dispatch");
  if (!a.send && !a.receive) c.fail("send and receive are both false: the launch would run neither half");
  c.count("num_tokens", a.num_tokens, "max_tokens", d.max_tokens);
  if (a.round_scale && !a.use_fp8) c.fail("round_scale needs use_fp8");
  if (a.ue8m0 && !(a.round_scale && d.hidden % 512 == 0))
    c.fail("ue8m0 needs use_fp8, round_scale and hidden a multiple of 512, got " + std::to_string(d.hidden));
  if (a.use_fp8 && d.hidden % 128 != 0)
    c.fail("use_fp8 needs hidden to be a multiple of 128, got " + std::to_string(d.hidden));
  if (a.use_nvfp4 && a.use_fp8) c.fail("use_nvfp4 and use_fp8 exclude each other");
  if (a.use_nvfp4 && d.hidden % kNvfp4Block != 0)
    c.fail("use_nvfp4 needs hidden to be a multiple of " + std::to_string(kNvfp4Block) + ", got " +
           std::to_string(d.hidden));
  if (!a.use_nvfp4 && a.x_global_scale != 0) c.fail("x_global_scale needs use_nvfp4");
  const bool in = a.send && a.num_tokens > 0;
  c.pointer("x", a.x, in);
  c.pointer("topk_idx", a.topk_idx, in);
  c.pointer("x_global_scale", a.x_global_scale, a.send && a.use_nvfp4);  // every send block reads it
  c.pointer("recv_x", a.recv_x, a.receive);
  c.pointer("recv_scales", a.recv_scales, a.receive && (a.use_fp8 || a.use_nvfp4));
  c.pointer("src_rank", a.src_rank, a.receive);
  c.pointer("src_index", a.src_index, a.receive);
  c.pointer("src_k", a.src_k, a.receive);
  c.pointer("count", a.count, a.receive);
}

void check(const Dims& d, const CombineLaunchArgs& a) {
  const ArgCheck c("LowLatencyContext.combine");
  if (!a.send && !a.receive) c.fail("send and receive are both false: the launch would run neither half");
  c.count("num_tokens", a.num_tokens, "max_tokens", d.max_tokens);
  c.pointer("y", a.y, a.send);
  c.pointer("src_rank", a.src_rank, a.send);
  c.pointer("src_index", a.src_index, a.send);
  c.pointer("src_k", a.src_k, a.send);
  c.pointer("count", a.count, a.send);
  c.pointer("topk_idx", a.topk_idx, a.send && a.num_tokens > 0);
  c.pointer("topk_weights", a.topk_weights, a.send && a.num_tokens > 0);
  c.pointer("out", a.out, a.receive && a.num_tokens > 0);
  c.at_least("num_sms", a.num_sms, 0);
  if (a.num_sms > 0) {  // overlap: the send half waits on comp_signal
    c.pointer("comp_signal", a.comp_signal, a.send);
    c.at_least("block_m", a.block_m, 1);
    c.at_least("threshold", a.threshold, 1);
  } else if (a.comp_signal != 0 || a.block_m != 0 || a.threshold != 0) {
    c.fail("comp_signal, block_m and threshold need num_sms > 0 (overlap)");
  }
}

}  // namespace

}  // namespace ll
}  // namespace moe_ep

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
  m.attr("NVFP4_BLOCK") = moe_ep::ll::kNvfp4Block;
  m.attr("NVFP4_E2M1_MAX") = moe_ep::ll::kNvfp4E2m1Max;
  m.attr("NVFP4_TILE_ROWS") = moe_ep::ll::kNvfp4TileRows;
  m.attr("NVFP4_TILE_GROUP_ROWS") = moe_ep::ll::kNvfp4TileGroupRows;
  m.attr("NVFP4_TILE_SCALES") = moe_ep::ll::kNvfp4TileScales;
  m.def(
      "ll_nvfp4_scale_offset",
      [](int scale_tiles, int row, int scale) {
        if (scale_tiles < 1 || row < 0 || scale < 0 || scale >= scale_tiles * moe_ep::ll::kNvfp4TileScales)
          throw std::invalid_argument(
              "ll_nvfp4_scale_offset: needs scale_tiles >= 1, row >= 0 and 0 <= scale < 4 * scale_tiles");
        return moe_ep::ll::nvfp4_scale_offset(scale_tiles, row, scale);
      },
      py::arg("scale_tiles"), py::arg("row"), py::arg("scale"),
      "Byte offset of row `row`'s scale `scale` in one local expert's NVFP4 scale tiles (kernels/low_latency/"
      "low_latency.h nvfp4_scale_offset), where moe_ep.comm.nvfp4's swizzled layout must put it.");
  m.def(
      "ll_nvfp4_cast_host",
      [](uintptr_t x, int num_rows, int hidden, float global_scale, uintptr_t values, uintptr_t scales) {
        const moe_ep::ArgCheck c("ll_nvfp4_cast_host");
        c.at_least("num_rows", num_rows, 0);
        c.positive_multiple("hidden", hidden, moe_ep::ll::kNvfp4Block);
        c.pointer("x", x, num_rows > 0);
        c.pointer("values", values, num_rows > 0);
        c.pointer("scales", scales, num_rows > 0);
        moe_ep::ll::nvfp4_cast_host(moe_ep::ll::Nvfp4HostCastArgs{x, num_rows, hidden, global_scale, values, scales});
      },
      py::kw_only(), py::arg("x"), py::arg("num_rows"), py::arg("hidden"), py::arg("global_scale"), py::arg("values"),
      py::arg("scales"),
      "The dispatch kernel's NVFP4 cast (kernels/low_latency/nvfp4.cuh) on the host: bf16 rows [num_rows, hidden] "
      "at host address x -> values [num_rows, hidden/2] uint8 and e4m3 scales [num_rows, hidden/16], row-major, "
      "with global scale g; for checks without a GPU.");
  namespace ll = moe_ep::ll;
  namespace na = moe_ep::named_args;
  using ll::LowLatencyParams;
  using D = ll::Dims;
  na::bind_args<D>(m, "LowLatencyDims",
                   "The fixed dimensions of one Buffer's low-latency kernels (low_latency.h Dims).",
                   na::required("rank", &D::rank), na::required("nranks", &D::nranks),
                   na::required("ranks_per_node", &D::ranks_per_node),
                   na::required("num_local_experts", &D::num_local_experts), na::required("num_topk", &D::num_topk),
                   na::required("hidden", &D::hidden), na::required("max_tokens", &D::max_tokens));
  using DA = ll::DispatchLaunchArgs;
  auto dispatch = na::bind_args<DA>(
      m, "LowLatencyDispatchArgs",
      "Arguments of one LowLatencyContext.dispatch launch (low_latency.h DispatchLaunchArgs): its send half, "
      "receive half, or both.",
      na::required("x", &DA::x), na::required("topk_idx", &DA::topk_idx), na::required("num_tokens", &DA::num_tokens),
      na::required("recv_x", &DA::recv_x), na::optional("recv_scales", &DA::recv_scales),
      na::required("src_rank", &DA::src_rank), na::required("src_index", &DA::src_index),
      na::required("src_k", &DA::src_k), na::required("count", &DA::count), na::required("use_fp8", &DA::use_fp8),
      na::required("round_scale", &DA::round_scale), na::optional("ue8m0", &DA::ue8m0),
      na::optional("use_nvfp4", &DA::use_nvfp4), na::optional("x_global_scale", &DA::x_global_scale),
      na::required("send", &DA::send),
      na::required("receive", &DA::receive));
  na::def_check<D>(dispatch, &ll::check);
  using CA = ll::CombineLaunchArgs;
  auto combine = na::bind_args<CA>(
      m, "LowLatencyCombineArgs",
      "Arguments of one LowLatencyContext.combine launch (low_latency.h CombineLaunchArgs): its send half, "
      "receive half, or both.",
      na::required("y", &CA::y), na::required("src_rank", &CA::src_rank), na::required("src_index", &CA::src_index),
      na::required("src_k", &CA::src_k), na::required("count", &CA::count), na::required("topk_idx", &CA::topk_idx),
      na::required("topk_weights", &CA::topk_weights), na::required("num_tokens", &CA::num_tokens),
      na::required("out", &CA::out), na::optional("num_sms", &CA::num_sms),
      na::optional("comp_signal", &CA::comp_signal), na::optional("block_m", &CA::block_m),
      na::optional("threshold", &CA::threshold), na::required("send", &CA::send), na::required("receive", &CA::receive));
  na::def_check<D>(combine, &ll::check);

  py::class_<LowLatencyParams>(m, "LowLatencyContext",
                               "Fixed state of one Buffer's low-latency kernels (addresses are device pointers).")
      .def(py::init(&ll::make_params), py::kw_only(), py::arg("runtime"), py::arg("ranks_per_node"),
           py::arg("num_local_experts"), py::arg("num_topk"), py::arg("hidden"), py::arg("max_tokens"),
           py::arg("epochs"), py::arg("masked"), py::arg("sym"), py::arg("node_sym"),
           py::arg("dispatch_payload_offset"), py::arg("dispatch_meta_offset"), py::arg("combine_payload_offset"),
           py::arg("combine_scratch_offset"), py::arg("signals_offset"), py::arg("done_counters"),
           py::arg("combine_stash"), py::arg("blocks_per_expert"), py::arg("num_sms"),
           "Checks every argument (ValueError naming it: a size out of range, a null address; masked may be 0).")
      .def_property_readonly("dims", &ll::dims_of, "The Buffer's LowLatencyDims.")
      .def(
          "dispatch",
          [](const LowLatencyParams& p, const DA& a, uintptr_t stream) {
            ll::check(ll::dims_of(p), a);
            ll::launch_dispatch(p, a, stream);
          },
          py::arg("args"), py::arg("stream"),
          "Check a LowLatencyDispatchArgs, then launch the dispatch kernel's send half (push each token to the "
          "ranks of its experts) and/or receive half (wait for every rank, expand staged tokens into "
          "expert-major rows).")
      .def(
          "combine",
          [](const LowLatencyParams& p, const CA& a, uintptr_t stream) {
            ll::check(ll::dims_of(p), a);
            ll::launch_combine(p, a, stream);
          },
          py::arg("args"), py::arg("stream"),
          "Check a LowLatencyCombineArgs, then launch the combine kernel's send half (push expert outputs back "
          "to their tokens' ranks) and/or receive half (wait for every rank, reduce each token's rows in "
          "ascending k into out).");
}
