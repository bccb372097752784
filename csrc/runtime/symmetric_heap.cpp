// The NVSHMEM symmetric heap: collective zero-filled allocations, their addresses at other PEs, and
// the host-side barrier over all PEs.
#include <nvshmem_host.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "runtime/error_check.h"
#include "runtime/runtime.h"

namespace moe_ep::runtime {

uintptr_t sym_malloc(size_t nbytes) {
  require_initialized("sym_malloc");
  void* ptr = nvshmem_malloc(nbytes);
  if (ptr == nullptr) {
    const char* heap = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
    throw std::runtime_error("moe_ep: nvshmem_malloc(" + std::to_string(nbytes) +
                             ") failed: the symmetric heap (NVSHMEM_SYMMETRIC_SIZE=" + (heap ? heap : "default") +
                             ") is full");
  }
  // Zero before any peer may write: the barrier orders every PE's memset before its first use.
  MOE_EP_CUDA_CHECK(cudaMemset(ptr, 0, nbytes));
  MOE_EP_CUDA_CHECK(cudaDeviceSynchronize());
  nvshmem_barrier_all();
  return reinterpret_cast<uintptr_t>(ptr);
}

void sym_free(uintptr_t ptr) {
  require_initialized("sym_free");
  // Local kernels finish, then the barrier makes sure no peer still reads or writes the allocation.
  MOE_EP_CUDA_CHECK(cudaDeviceSynchronize());
  nvshmem_barrier_all();
  nvshmem_free(reinterpret_cast<void*>(ptr));
}

uintptr_t peer_ptr(uintptr_t ptr, int pe) {
  require_initialized("peer_ptr");
  return reinterpret_cast<uintptr_t>(nvshmem_ptr(reinterpret_cast<void*>(ptr), pe));
}

void barrier_all() {
  require_initialized("barrier_all");
  nvshmem_barrier_all();
}

}  // namespace moe_ep::runtime
