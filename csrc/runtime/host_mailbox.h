// A small host-mapped int32 array: a kernel writes it through its device address and the host reads it
// after one stream synchronisation, with no device-to-host copy (the counts a notify kernel returns).
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "runtime/error_check.h"

namespace moe_ep {

class HostMailbox {
 public:
  HostMailbox(int entries, const std::string& what) : entries_(entries) {
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&host_), entries * sizeof(int), cudaHostAllocMapped),
               ("cudaHostAlloc(" + what + ")").c_str());
    const cudaError_t status = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0);
    if (status != cudaSuccess) {
      close();
      check_cuda(status, ("cudaHostGetDevicePointer(" + what + ")").c_str());
    }
  }
  HostMailbox(const HostMailbox&) = delete;
  HostMailbox& operator=(const HostMailbox&) = delete;
  ~HostMailbox() { close(); }

  // Frees the memory (no kernel may write it afterwards); later reads return nothing.
  void close() {
    if (host_ != nullptr) cudaFreeHost(host_);
    host_ = nullptr;
    device_ = nullptr;
  }

  uintptr_t device() const { return reinterpret_cast<uintptr_t>(device_); }

  // Entries [first, first + count).
  std::vector<int> read(int first, int count) const {
    if (host_ == nullptr) return {};
    return std::vector<int>(host_ + first, host_ + first + count);
  }

 private:
  int entries_ = 0;
  int* host_ = nullptr;
  int* device_ = nullptr;
};

}  // namespace moe_ep
