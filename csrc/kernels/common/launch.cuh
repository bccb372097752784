// How a normal-mode kernel's launch is checked (host) and how its grid learns that it is done
// (device): shared by the NVLink kernels (kernels/intranode/) and the cross-node kernels
// (kernels/internode/). Their Context::block_counters hold the arrival counters.
#pragma once
#include <cuda_runtime.h>

#include "runtime/error_check.h"

namespace moe_ep {

// Throws with the kernel's name when the launch failed.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// End of a kernel. Every thread fences, then thread 0 counts the block in; returns true (in thread 0
// of the last block to arrive only) once all gridDim.x blocks have arrived, i.e. once no thread of
// the grid will read the epochs or take work items again (fence / counter / fence). That thread
// resets the counter for the next kernel.
__device__ __forceinline__ bool arrive_last(int* counter) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x != 0) return false;
  if (atomicAdd(counter, 1) != static_cast<int>(gridDim.x) - 1) return false;
  __threadfence();
  *counter = 0;
  return true;
}

}  // namespace moe_ep
