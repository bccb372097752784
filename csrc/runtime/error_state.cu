// The host-mapped ErrorState (comm.h) that a timed-out wait fills in, and the names of the phases it
// reports. Host-mapped so the host reads it without synchronising with the device.
#include <cstddef>
#include <cstring>
#include <tuple>

#include "runtime/comm.h"
#include "runtime/error_check.h"
#include "runtime/runtime.h"

namespace moe_ep::runtime {

namespace {

// Index = comm.h Phase; the text is the phase's comment there.
constexpr const char* kPhaseNames[] = {
    "none",
    "dispatch: waiting for a peer's token counts",
    "dispatch: waiting for a peer to be ready to receive",
    "dispatch: waiting for a peer's rows to land",
    "combine: waiting for a peer to be ready to receive",
    "combine: waiting for a peer's rows to land",
    "low-latency dispatch: waiting for a peer's rows/counts",
    "low-latency combine: waiting for a peer's rows",
    "low-latency: waiting for a peer to free its buffers",
    "cross-node dispatch: waiting for a peer's token counts",
    "cross-node dispatch: waiting for a remote forwarder to free a buffer",
    "cross-node dispatch: forwarder waiting for a remote node's rows",
    "cross-node dispatch: forwarder waiting for a local rank to free a buffer",
    "cross-node dispatch: waiting for a forwarder's rows",
    "cross-node combine: forwarder waiting for a local rank's rows",
    "cross-node combine: waiting for a rank to free a buffer",
    "cross-node combine: waiting for a node's partial sums",
    "cross-node: waiting for a peer to finish its previous call",
    "low-latency combine: waiting for this rank's GEMM to signal comp_signal",
    "every call: waiting for a peer's call stamp (the peer has not made this call)",
};
static_assert(sizeof(kPhaseNames) / sizeof(kPhaseNames[0]) == kNumPhases, "kPhaseNames must name every Phase");

}  // namespace

std::pair<uintptr_t, uintptr_t> alloc_error_state() {
  ErrorState* host = nullptr;
  MOE_EP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), sizeof(ErrorState), cudaHostAllocMapped));
  std::memset(host, 0, sizeof(ErrorState));
  ErrorState* device = nullptr;
  const cudaError_t status = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), host, 0);
  if (status != cudaSuccess) {
    cudaFreeHost(host);
    check_cuda(status, "cudaHostGetDevicePointer(ErrorState)");
  }
  return {reinterpret_cast<uintptr_t>(host), reinterpret_cast<uintptr_t>(device)};
}

void free_error_state(uintptr_t host_ptr) { MOE_EP_CUDA_CHECK(cudaFreeHost(reinterpret_cast<void*>(host_ptr))); }

size_t error_state_bytes() { return sizeof(ErrorState); }

std::vector<std::tuple<std::string, size_t, size_t>> error_state_fields() {
#define MOE_EP_FIELD(f) std::make_tuple(std::string(#f), offsetof(ErrorState, f), sizeof(ErrorState::f))
  return {MOE_EP_FIELD(code),     MOE_EP_FIELD(rank),  MOE_EP_FIELD(phase),     MOE_EP_FIELD(peer),
          MOE_EP_FIELD(stamp_slot), MOE_EP_FIELD(bad_claim), MOE_EP_FIELD(bad_id), MOE_EP_FIELD(bad_token),
          MOE_EP_FIELD(bad_k),    MOE_EP_FIELD(bad_value)};
#undef MOE_EP_FIELD
}

std::vector<std::string> phase_names() { return {std::begin(kPhaseNames), std::end(kPhaseNames)}; }

}  // namespace moe_ep::runtime
