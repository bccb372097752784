// NVSHMEM bootstrap from a unique id: one rank creates the id, every rank initialises from it, and
// finalize tears it down again. NVSHMEM 3.4.5 and 3.8.0 both finalise the unique-id bootstrap inside
// nvshmem_finalize (and re-read NVSHMEM_* options on the next init), so one process may finalise and
// later initialise again, from a fresh id and with a different heap size.
#include <nvshmem_host.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "runtime/error_check.h"
#include "runtime/runtime.h"

namespace moe_ep::runtime {

std::string unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  MOE_EP_NVSHMEM_CHECK(nvshmemx_get_uniqueid(&id));
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

bool is_initialized() {
  const int status = nvshmemx_init_status();
  return status >= NVSHMEM_STATUS_IS_INITIALIZED && status != NVSHMEM_STATUS_INVALID;
}

void require_initialized(const char* what) {
  if (!is_initialized()) throw std::runtime_error(std::string("moe_ep: ") + what + " needs NVSHMEM, which is not initialised");
}

void init(const std::string& uid, int rank, int nranks, int device, size_t heap_bytes) {
  if (is_initialized()) throw std::runtime_error("moe_ep: NVSHMEM is already initialised in this process");
  if (uid.size() != sizeof(nvshmemx_uniqueid_t)) {
    throw std::invalid_argument("moe_ep: a unique id has " + std::to_string(sizeof(nvshmemx_uniqueid_t)) +
                                " bytes, got " + std::to_string(uid.size()));
  }
  MOE_EP_CUDA_CHECK(cudaSetDevice(device));
  // NVSHMEM exits the process when it cannot map its heap; report that case as an error instead.
  size_t free_bytes = 0, total_bytes = 0;
  MOE_EP_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (heap_bytes > free_bytes) {
    throw std::runtime_error("moe_ep: an NVSHMEM heap of " + std::to_string(heap_bytes) + " bytes does not fit in the " +
                             std::to_string(free_bytes) + " bytes free on GPU " + std::to_string(device));
  }
  // Read by nvshmemx_init_attr: the heap is sized by the caller; NVLink multicast stays off unless
  // the user asked for it.
  setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(heap_bytes).c_str(), 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 0);

  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  MOE_EP_NVSHMEM_CHECK(nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr));
  MOE_EP_NVSHMEM_CHECK(nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr));
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != nranks) {
    throw std::runtime_error("moe_ep: NVSHMEM started as PE " + std::to_string(nvshmem_my_pe()) + " of " +
                             std::to_string(nvshmem_n_pes()) + ", expected " + std::to_string(rank) + " of " +
                             std::to_string(nranks));
  }
}

void finalize() {
  if (!is_initialized()) return;
  MOE_EP_CUDA_CHECK(cudaDeviceSynchronize());
  nvshmem_finalize();
}

int my_pe() {
  require_initialized("my_pe");
  return nvshmem_my_pe();
}

int n_pes() {
  require_initialized("n_pes");
  return nvshmem_n_pes();
}

}  // namespace moe_ep::runtime
