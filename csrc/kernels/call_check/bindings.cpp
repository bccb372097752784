// Python bindings of the stamp exchange (stamp_exchange.h, in this folder): one StampExchangeContext per
// native Buffer holds the fixed addresses and the host-mapped mailbox; exchange() launches the kernel.
// The table's layout is this folder's: STAMP_ROW_WORDS and stamp_exchange_heap_bytes / _table_bytes
// tell Python (moe_ep/comm/backends/stamp_exchange.py) where every rank's row lies.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "kernels/call_check/stamp_exchange.h"
#include "runtime/context.h"
#include "runtime/host_mailbox.h"
#include "runtime/named_args.h"

namespace py = pybind11;

namespace moe_ep {
namespace call_check {

namespace {

class StampExchangeContext {
 public:
  // Checks every address (ValueError naming it) before it allocates the host mailbox.
  StampExchangeContext(const RuntimeContext& rt, uintptr_t epoch, uintptr_t symmetric)
      : ctx_(make(rt, epoch, symmetric)), mailbox_(kMailboxEntries, "stamp exchange mailbox") {
    ctx_.mailbox = mailbox_.device();
  }

  ~StampExchangeContext() { close(); }

  void close() { mailbox_.close(); }

  // Launches the exchange of `stamp` (kStampWords int32) and this rank's token count on `stream`.
  void exchange(const std::vector<int>& stamp, int num_tokens, uintptr_t masked, uintptr_t stream) const {
    const ArgCheck c("StampExchangeContext.exchange");
    if (stamp.size() != static_cast<size_t>(kStampWords))
      c.fail("stamp has " + std::to_string(stamp.size()) + " words, expected " + std::to_string(kStampWords));
    c.at_least("num_tokens", num_tokens, 0);
    Args a{};
    for (int w = 0; w < kStampWords; ++w) a.stamp[w] = stamp[w];
    a.num_tokens = num_tokens;
    a.masked = masked;
    launch_exchange(ctx_, a, stream);
  }

  // The most tokens any rank brought to the last exchange; valid once the host synchronised with it.
  int max_tokens() const {
    const std::vector<int> v = mailbox_.read(kMailboxMaxTokens, 1);
    return v.empty() ? 0 : v[0];
  }

 private:
  static Context make(const RuntimeContext& rt, uintptr_t epoch, uintptr_t symmetric) {
    const ArgCheck c("StampExchangeContext");
    c.pointer("epoch", epoch);
    c.pointer("symmetric", symmetric);
    return Context{rt.rank, rt.nranks, rt.timeout_ns, rt.error, rt.verdict, epoch, symmetric, 0};
  }

  Context ctx_;
  HostMailbox mailbox_;
};

}  // namespace

}  // namespace call_check
}  // namespace moe_ep

void register_call_check(py::module_& m) {
  namespace cc = moe_ep::call_check;
  m.attr("STAMP_WORDS") = moe_ep::kStampWords;
  m.attr("STAMP_ROW_WORDS") = cc::kRowWords;
  m.def("stamp_exchange_table_bytes", &cc::table_bytes, py::arg("nranks"),
        "Bytes of the stamp table int32 [2][nranks][STAMP_ROW_WORDS] at the start of the exchange's symmetric memory.");
  m.def("stamp_exchange_heap_bytes", &cc::heap_bytes, py::arg("nranks"),
        "Symmetric bytes of one Buffer's stamp exchange: the table, then the flags uint64 [nranks].");
  py::class_<cc::StampExchangeContext>(m, "StampExchangeContext",
                                       "One Buffer's stamp exchange (kernels/call_check/stamp_exchange.h).")
      .def(py::init<const moe_ep::RuntimeContext&, uintptr_t, uintptr_t>(), py::kw_only(), py::arg("runtime"),
           py::arg("epoch"), py::arg("symmetric"),
           "epoch: uint64 in device memory (zero); symmetric: stamp_exchange_heap_bytes zero bytes of the heap.")
      .def("close", &cc::StampExchangeContext::close, "Free the host mailbox.")
      .def("exchange", &cc::StampExchangeContext::exchange, py::arg("stamp"), py::arg("num_tokens"),
           py::arg("masked"), py::arg("stream"),
           "Launch the exchange of this call's stamp and token count (masked: int32 [R] of a fault-tolerant "
           "low-latency call, or 0).")
      .def("max_tokens", &cc::StampExchangeContext::max_tokens,
           "The most tokens any rank brought to the last exchange (once the host synchronised with it).");
}
