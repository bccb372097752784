// The moe_ep.comm._C module: one pybind11 module over the runtime and the kernels (no libtorch). Each part
// registers its own functions.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_runtime(py::module_& m);      // runtime/runtime_bindings.cpp
void register_intranode(py::module_& m);    // kernels/intranode/bindings.cpp
void register_low_latency(py::module_& m);  // kernels/low_latency/bindings.cpp
void register_internode(py::module_& m);    // kernels/internode/bindings.cpp
void register_call_check(py::module_& m);   // kernels/call_check/bindings.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "moe_ep native core: NVSHMEM runtime and dispatch/combine kernels over raw device pointers";
  register_runtime(m);
  register_intranode(m);
  register_low_latency(m);
  register_internode(m);
  register_call_check(m);
}
