// The moe_ep.moe._gemm module: the FP8 grouped GEMM (fp8_grouped_gemm.h) for the model layer, a pybind11
// module of its own, apart from moe_ep.comm._C (no NVSHMEM, no relocatable device code, no libtorch). Tensors
// travel as device addresses (int), the stream as cudaStream_t (int). grouped_gemm checks its argument struct
// first (ValueError naming the field), then launches without synchronising.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstdint>
#include <map>
#include <string>

#include "gemm/fp8_grouped_gemm.h"
#include "runtime/named_args.h"

namespace py = pybind11;

namespace moe_ep {
namespace gemm {
namespace {

constexpr const char* kWhere = "fp8_grouped_gemm";

void check_aligned(const ArgCheck& c, const char* name, uintptr_t value, uintptr_t bytes) {
  if (value % bytes != 0)
    c.fail(std::string(name) + " = " + std::to_string(value) + " is not " + std::to_string(bytes) + "-byte aligned");
}

// Every field the kernels rely on (fp8_grouped_gemm.h), except the workspace size, which the launcher checks
// against this device. A call with rows = 0 has nothing to do and checks only the sizes.
void check(const GroupedGemmArgs& a) {
  const ArgCheck c(kWhere);
  c.in_range("rows", a.rows, 0, INT_MAX);
  c.positive_multiple("n", a.n, kScaleBlock);
  c.positive_multiple("k", a.k, kScaleBlock);
  c.in_range("n", a.n, 1, INT_MAX);
  c.in_range("k", a.k, 1, INT_MAX);
  c.in_range("groups", a.groups, 1, INT_MAX);
  c.in_range("config", a.config, 0, kNumTileConfigs - 1);
  c.in_range("raster", a.raster, 0, kNumRasters - 1);
  if (a.rows == 0) return;
  for (const auto& [name, value] : {std::pair<const char*, uintptr_t>{"a", a.a}, {"a_scale", a.a_scale},
                                    {"b", a.b}, {"b_scale", a.b_scale}, {"counts", a.counts}, {"out", a.out},
                                    {"workspace", a.workspace}})
    c.pointer(name, value);
  check_aligned(c, "a", a.a, 16);
  check_aligned(c, "b", a.b, 16);
  check_aligned(c, "out", a.out, 16);
  check_aligned(c, "a_scale", a.a_scale, 4);
  check_aligned(c, "b_scale", a.b_scale, 4);
  check_aligned(c, "counts", a.counts, 4);
  check_aligned(c, "workspace", a.workspace, 128);
}

void checked_grouped_gemm(const GroupedGemmArgs& args) {
  check(args);
  if (args.rows == 0) return;
  py::gil_scoped_release no_gil;
  grouped_gemm(args);
}

}  // namespace
}  // namespace gemm
}  // namespace moe_ep

PYBIND11_MODULE(_gemm, m) {
  namespace g = moe_ep::gemm;
  namespace na = moe_ep::named_args;
  m.doc() = "moe_ep FP8 grouped GEMM with DeepSeek-V3 block scales on sm90 (CUTLASS) over raw device pointers";
  m.attr("SCALE_BLOCK") = g::kScaleBlock;
  m.attr("TILE_CONFIGS") = std::map<std::string, int>{
      {"cooperative_128x128", static_cast<int>(g::TileConfig::kCooperative128)},
      {"pingpong_64x128", static_cast<int>(g::TileConfig::kPingpong64)}};
  m.attr("RASTERS") = std::map<std::string, int>{{"along_m", static_cast<int>(g::Raster::kAlongM)},
                                                 {"along_n", static_cast<int>(g::Raster::kAlongN)}};

  using A = g::GroupedGemmArgs;
  na::bind_args<A>(m, "GroupedGemmArgs", "Arguments of grouped_gemm (csrc/gemm/fp8_grouped_gemm.h GroupedGemmArgs).",
                   na::required("a", &A::a), na::required("a_scale", &A::a_scale), na::required("b", &A::b),
                   na::required("b_scale", &A::b_scale), na::required("counts", &A::counts),
                   na::required("out", &A::out), na::required("workspace", &A::workspace),
                   na::required("workspace_bytes", &A::workspace_bytes), na::required("rows", &A::rows),
                   na::required("n", &A::n), na::required("k", &A::k), na::required("groups", &A::groups),
                   na::required("config", &A::config), na::required("raster", &A::raster),
                   na::required("stream", &A::stream))
      .def("check", &g::check, "Raise ValueError naming the field when these arguments break a rule of the kernel.");
  m.def("grouped_gemm", &g::checked_grouped_gemm, py::arg("args"),
        "Check args, then launch on args.stream the per-group table kernel and the CUTLASS grouped GEMM "
        "(no synchronisation; nothing when rows is 0).");
  m.def("workspace_bytes", &g::workspace_bytes, py::arg("groups"), py::arg("config"),
        "Device bytes of the workspace one call with `groups` groups and TILE_CONFIGS value `config` needs "
        "on the current device.");
}
