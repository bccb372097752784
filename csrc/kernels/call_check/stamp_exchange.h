// The stamp exchange: the first kernel of every call of a native Buffer, before any kernel that moves
// data. Every rank gives every rank its call stamp (runtime/call_stamp.h: kind, call number, the
// handle's call, size, status, reason) and its token count; each rank then knows whether the ranks
// make the same call (else ErrorState kErrorMismatch, and the call's other kernels do nothing:
// comm.h stamps_disagreed) and the most tokens any rank brings (a fresh dispatch's token rounds).
// Protocol: stamp_exchange.cu. Python: moe_ep/comm/backends/stamp_exchange.py. Host and device.
#pragma once
#include <cstddef>
#include <cstdint>

#include "runtime/call_stamp.h"
#include "runtime/host_device.h"

namespace moe_ep {
namespace call_check {

// One row of the stamp table: the stamp's words, then the rank's token count (not compared).
constexpr int kRowWords = kStampWords + 1;
constexpr int kRowTokens = kStampWords;
constexpr int kComparedWords = 4;  // kind, call, handle call, size: what every rank must agree on
constexpr int kThreads = 1024;     // one block; thread p serves peer p, p + 1024, ...

// Symmetric memory of one Buffer's exchange: the table int32 [2][R][kRowWords] (slot = epoch & 1,
// row = source rank), then the flags uint64 [R] (flag [s] = the last epoch source s finished writing).
MOE_EP_HOST_DEVICE inline size_t table_bytes(int nranks) {
  return (static_cast<size_t>(2) * nranks * kRowWords * sizeof(int) + 15) / 16 * 16;
}
inline size_t heap_bytes(int nranks) { return table_bytes(nranks) + static_cast<size_t>(nranks) * sizeof(uint64_t); }

// Host mailbox entries (host-mapped int32) the exchange writes: the most tokens over the ranks it heard.
constexpr int kMailboxMaxTokens = 0;
constexpr int kMailboxEntries = 1;

// Fixed for one Buffer (bindings.cpp builds and checks it).
struct Context {
  int rank;
  int nranks;
  unsigned long long timeout_ns;
  uintptr_t error;      // host-mapped ErrorState (device address)
  uintptr_t verdict;    // int32 in device memory: this exchange's verdict for the call's other kernels (comm.h)
  uintptr_t epoch;      // uint64 in device memory: the last epoch this rank's exchanges used
  uintptr_t symmetric;  // this rank's table + flags (symmetric address: NVSHMEM puts and signals)
  uintptr_t mailbox;    // host-mapped int32 [kMailboxEntries] (device address)
};

// One call's exchange.
struct Args {
  int stamp[kStampWords];
  int num_tokens;    // this rank's tokens in the call
  uintptr_t masked;  // int32 [R] of a fault-tolerant low-latency call (skip masked peers; mask a silent one), or 0
};

void launch_exchange(const Context& c, const Args& a, uintptr_t stream);

}  // namespace call_check
}  // namespace moe_ep
