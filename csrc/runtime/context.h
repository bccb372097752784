// What every mode's context shares, checked and built once per Buffer: which rank this is of how many,
// how long a wait for a peer may last, where a kernel records a failure (the host-mapped ErrorState
// of runtime/comm.h, which moe_ep/comm/errors.py turns into an exception) and where the call's stamp
// exchange leaves its verdict for the call's other kernels (comm.h block_stamps_disagreed). Python builds one
// RuntimeContext per native Buffer (moe_ep/comm/backends/nvshmem.py) and hands it to each mode's context
// (IntranodeContext, InternodeContext, LowLatencyContext), which adds its own fields and owns its
// layout. Host only.
#pragma once
#include <cstdint>
#include <string>

#include "runtime/named_args.h"

namespace moe_ep {

struct RuntimeContext {
  int rank;
  int nranks;
  double timeout_s;               // as given; kernels read timeout_ns
  unsigned long long timeout_ns;  // a wait gives up after this long (comm.h stop_waiting)
  uintptr_t error;                // device address of the host-mapped ErrorState
  uintptr_t verdict;              // device address of an int32 in device memory: the stamp verdict (comm.h)
};

// Checked (ValueError naming the field): 0 <= rank < nranks, a positive finite timeout, non-null error and
// verdict.
inline RuntimeContext make_runtime_context(int rank, int nranks, double timeout_s, uintptr_t error,
                                           uintptr_t verdict) {
  const ArgCheck c("RuntimeContext");
  c.at_least("nranks", nranks, 1);
  c.in_range("rank", rank, 0, nranks - 1);
  if (!(timeout_s > 0.0) || timeout_s > 1e9)
    c.fail("timeout_s = " + std::to_string(timeout_s) + ", expected a positive number of seconds (at most 1e9)");
  c.pointer("error", error);
  c.pointer("verdict", verdict);
  return RuntimeContext{rank, nranks, timeout_s, static_cast<unsigned long long>(timeout_s * 1e9), error, verdict};
}

}  // namespace moe_ep
