// The moe_ep.moe._gemm module: the FP8 grouped GEMMs (fp8_grouped_gemm.h: grouped_gemm, and wgrad_gemm for the
// weight gradient) for the model layer, a pybind11 module of its own, apart from moe_ep.comm._C (no NVSHMEM, no
// relocatable device code, no libtorch). Tensors travel as device addresses (int), the stream as cudaStream_t
// (int). grouped_gemm and wgrad_gemm check their argument struct first (ValueError naming the field), then
// launch without synchronising.
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
constexpr const char* kWgradWhere = "fp8_wgrad_gemm";

void check_aligned(const ArgCheck& c, const char* name, uintptr_t value, uintptr_t bytes) {
  if (value % bytes != 0)
    c.fail(std::string(name) + " = " + std::to_string(value) + " is not " + std::to_string(bytes) + "-byte aligned");
}

// The addresses both argument structs carry: none null, TMA's operands 16-byte aligned, the others aligned to
// their elements, the workspace to its tables.
template <class Args>
void check_addresses(const ArgCheck& c, const Args& a) {
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
  check_addresses(c, a);
}

void checked_grouped_gemm(const GroupedGemmArgs& args) {
  check(args);
  if (args.rows == 0) return;
  py::gil_scoped_release no_gil;
  grouped_gemm(args);
}

// Every field wgrad_gemm relies on (fp8_grouped_gemm.h WgradGemmArgs), except the workspace size (checked by the
// launcher against this device) and the sizes of the scale buffers (the Python wrapper checks the tensors).
// Every call launches: with no tokens every out[e] is zeroed.
void check_wgrad(const WgradGemmArgs& a) {
  const ArgCheck c(kWgradWhere);
  c.in_range("m", a.m, 1, INT_MAX);
  c.positive_multiple("n", a.n, 8);
  c.in_range("n", a.n, 1, INT_MAX);
  c.in_range("tokens", a.tokens, 0, INT_MAX);
  c.in_range("groups", a.groups, 1, kMaxWgradGroups);
  c.positive_multiple("columns", a.columns, kGroupColumnAlign);
  c.count("tokens + 15 * groups", a.tokens + (kGroupColumnAlign - 1) * a.groups, "columns", a.columns);
  c.in_range("config", a.config, 0, kNumWgradTileConfigs - 1);
  c.in_range("raster", a.raster, 0, kNumRasters - 1);
  check_addresses(c, a);
}

void checked_wgrad_gemm(const WgradGemmArgs& args) {
  check_wgrad(args);
  py::gil_scoped_release no_gil;
  wgrad_gemm(args);
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
  m.attr("WGRAD_TILE_CONFIGS") = std::map<std::string, int>{
      {"cooperative_128x128", static_cast<int>(g::WgradTileConfig::kWgradCooperative128)}};
  m.attr("GROUP_COLUMN_ALIGN") = g::kGroupColumnAlign;

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

  using W = g::WgradGemmArgs;
  na::bind_args<W>(m, "WgradGemmArgs", "Arguments of wgrad_gemm (csrc/gemm/fp8_grouped_gemm.h WgradGemmArgs).",
                   na::required("a", &W::a), na::required("a_scale", &W::a_scale), na::required("b", &W::b),
                   na::required("b_scale", &W::b_scale), na::required("counts", &W::counts),
                   na::required("out", &W::out), na::required("workspace", &W::workspace),
                   na::required("workspace_bytes", &W::workspace_bytes), na::required("m", &W::m),
                   na::required("n", &W::n), na::required("tokens", &W::tokens),
                   na::required("columns", &W::columns), na::required("groups", &W::groups),
                   na::required("config", &W::config), na::required("raster", &W::raster),
                   na::required("stream", &W::stream))
      .def("check", &g::check_wgrad,
           "Raise ValueError naming the field when these arguments break a rule of the kernel.");
  m.def("wgrad_gemm", &g::checked_wgrad_gemm, py::arg("args"),
        "Check args, then launch on args.stream the per-group table kernel, the kernel that zeros the output of "
        "the groups without tokens, and the CUTLASS K-grouped GEMM (no synchronisation).");
  m.def("wgrad_workspace_bytes", &g::wgrad_workspace_bytes, py::arg("groups"), py::arg("config"),
        "Device bytes of the workspace one wgrad_gemm call with `groups` groups and WGRAD_TILE_CONFIGS value "
        "`config` needs on the current device.");
}
