// Python bindings of the intranode (normal-mode) kernels. Owned by the intranode kernels' author.
#include <pybind11/pybind11.h>
namespace py = pybind11;
void register_intranode(py::module_& m) { (void)m; }
