// What ErrorState::code (runtime/comm.h) says made a call void; the first record wins. Host and device
// (runtime_bindings.cpp exports the values as ERROR_TIMEOUT and ERROR_MISMATCH for moe_ep/comm/errors.py).
#pragma once

namespace moe_ep {

enum ErrorCode : int {
  kErrorNone = 0,
  kErrorTimeout = 1,   // a wait for a peer gave up (rank, phase, peer)
  kErrorMismatch = 2,  // the ranks' call stamps differ (kernels/call_check/stamp_exchange.cu): rank, peer, stamp_slot
};

}  // namespace moe_ep
