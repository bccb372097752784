// Device side of a call's stamp (runtime/call_stamp.h): what a normal-mode notify kernel sends.
#pragma once
#include "runtime/call_stamp.h"
#include "runtime/comm.h"

namespace moe_ep {

// Word j of this rank's stamp (call_stamp.h) as a notify kernel sends it: where the host gave status 0
// but an expert id outside [-1, E) has been recorded (this call's layout, or an earlier call's that the
// host has not read yet), kStampBadIds, so every rank raises. Read once the whole layout is done (notify:
// after every block's slice arrived).
__device__ __forceinline__ int sent_stamp_word(const ErrorState* error, const int* stamp, int j) {
  if (j == kStampStatus && stamp[j] == 0 && *reinterpret_cast<const volatile int*>(&error->bad_claim) != 0)
    return kStampBadIds;
  return stamp[j];
}

}  // namespace moe_ep
