// How a normal-mode kernel's launch is checked (host) and how its grid learns that it is done
// (device): shared by the NVLink kernels (kernels/intranode/) and the cross-node kernels
// (kernels/internode/). Their Context::block_counters hold the arrival counters.
#pragma once
#include <cuda_runtime.h>

#include "runtime/error_check.h"

namespace moe_ep {

// Throws with the kernel's name when the launch failed.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// End of a block's work. Every thread fences, then thread 0 counts the block in; returns true in every
// thread of the last block to arrive (fence / counter / fence: every other block's writes before its
// arrival are visible to it), which resets the counter for the next kernel.
__device__ __forceinline__ bool block_arrives_last(int* counter) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
    if (last) {
      __threadfence();
      *counter = 0;
    }
  }
  __syncthreads();
  return last != 0;
}

// End of a kernel: block_arrives_last, true in thread 0 of the last block only, once no thread of the
// grid will read the epochs or take work items again.
__device__ __forceinline__ bool arrive_last(int* counter) { return block_arrives_last(counter) && threadIdx.x == 0; }

}  // namespace moe_ep
