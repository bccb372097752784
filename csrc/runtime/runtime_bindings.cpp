// Python bindings of the runtime (register_runtime, called from bindings.cpp). Calls that block on
// peers or on the device release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "runtime/context.h"
#include "runtime/error_code.h"
#include "runtime/limits.h"
#include "runtime/runtime.h"

namespace py = pybind11;
namespace rt = moe_ep::runtime;

void register_runtime(py::module_& m) {
  using release_gil = py::call_guard<py::gil_scoped_release>;
  m.attr("MAX_NODE_RANKS") = moe_ep::kMaxNodeRanks;
  m.attr("MAX_TOPK") = moe_ep::kMaxTopk;
  m.attr("MAX_RANKS_PER_GPU") = moe_ep::kMaxRanksPerGpu;

  m.def(
      "get_unique_id",
      [] {
        std::string id;
        {
          py::gil_scoped_release no_gil;
          id = rt::unique_id();
        }
        return py::bytes(id);
      },
      "A fresh NVSHMEM unique id (bytes) for init(); created by one rank and sent to the others.");
  m.def("init", &rt::init, py::arg("uid"), py::arg("rank"), py::arg("nranks"), py::arg("device"),
        py::arg("heap_bytes"), release_gil(),
        "Collective: initialise NVSHMEM as PE `rank` of `nranks` on CUDA device `device`, with a symmetric "
        "heap of `heap_bytes` (NVSHMEM_SYMMETRIC_SIZE; NVSHMEM_DISABLE_NVLS defaults to 1).");
  m.def("finalize", &rt::finalize, release_gil(),
        "Collective: finalise NVSHMEM (no-op when not initialised); init() may be called again later.");
  m.def("is_initialized", &rt::is_initialized, "Whether NVSHMEM is initialised in this process.");
  m.def("my_pe", &rt::my_pe, "This process's NVSHMEM PE.");
  m.def("n_pes", &rt::n_pes, "The number of NVSHMEM PEs.");
  m.def("sym_malloc", &rt::sym_malloc, py::arg("nbytes"), release_gil(),
        "Collective: allocate `nbytes` (> 0) zero-filled bytes on the symmetric heap; returns the device address.");
  m.def("sym_free", &rt::sym_free, py::arg("ptr"), release_gil(),
        "Collective: free a sym_malloc allocation once every PE has stopped using it.");
  m.def("peer_ptr", &rt::peer_ptr, py::arg("ptr"), py::arg("pe"),
        "Address of symmetric allocation `ptr` at PE `pe` as seen from this GPU (nvshmem_ptr); 0 when "
        "`pe` is not reachable by loads and stores.");
  m.def("barrier_all", &rt::barrier_all, release_gil(), "Collective: host-side barrier over all PEs.");
  m.def("build_version", &rt::build_version, "NVSHMEM version (major, minor, patch) of the headers at build time.");
  m.def("runtime_version", &rt::runtime_version, "NVSHMEM version (major, minor, patch) of the loaded host library.");
  m.def("alloc_error_state", &rt::alloc_error_state,
        "Allocate a zeroed host-mapped ErrorState (runtime/comm.h); returns (host_ptr, device_ptr).");
  m.def("free_error_state", &rt::free_error_state, py::arg("host_ptr"), release_gil(),
        "Free an ErrorState from alloc_error_state().");
  m.def("error_state_bytes", &rt::error_state_bytes, "sizeof(ErrorState) (runtime/comm.h).");
  m.def("error_state_fields", &rt::error_state_fields,
        "(name, offset, size) of every ErrorState field (runtime/comm.h), in order.");
  m.attr("ERROR_TIMEOUT") = static_cast<int>(moe_ep::kErrorTimeout);
  m.attr("ERROR_MISMATCH") = static_cast<int>(moe_ep::kErrorMismatch);
  m.def("phase_names", &rt::phase_names, "Names of the comm.h Phase values, by index.");
  m.def("sm_count", &rt::sm_count, py::arg("device"), "Number of SMs of CUDA device `device`.");

  py::class_<moe_ep::RuntimeContext>(m, "RuntimeContext",
                                     "What every mode's context shares, built once per Buffer (runtime/context.h).")
      .def(py::init(&moe_ep::make_runtime_context), py::kw_only(), py::arg("rank"), py::arg("nranks"),
           py::arg("timeout_s"), py::arg("error"), py::arg("verdict"),
           "Checks every field (ValueError naming it): rank of nranks, a positive timeout, non-null error and "
           "verdict (an int32 in device memory, zero before the first call).")
      .def_readonly("rank", &moe_ep::RuntimeContext::rank)
      .def_readonly("nranks", &moe_ep::RuntimeContext::nranks)
      .def_readonly("timeout_s", &moe_ep::RuntimeContext::timeout_s)
      .def_readonly("error", &moe_ep::RuntimeContext::error)
      .def_readonly("verdict", &moe_ep::RuntimeContext::verdict);
}
