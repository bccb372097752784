// Turns failed CUDA and NVSHMEM calls into C++ exceptions (RuntimeError in Python) that name the call,
// the error and its code.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace moe_ep {

inline void check_cuda(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so the next call does not report it again
  throw std::runtime_error(std::string("moe_ep: ") + call + " failed: " + cudaGetErrorName(status) + " (" +
                           std::to_string(static_cast<int>(status)) + "): " + cudaGetErrorString(status));
}

inline void check_nvshmem(int status, const char* call) {
  if (status == 0) return;
  throw std::runtime_error(std::string("moe_ep: ") + call + " failed with NVSHMEM status " + std::to_string(status));
}

}  // namespace moe_ep

#define MOE_EP_CUDA_CHECK(call) ::moe_ep::check_cuda((call), #call)
#define MOE_EP_NVSHMEM_CHECK(call) ::moe_ep::check_nvshmem((call), #call)
