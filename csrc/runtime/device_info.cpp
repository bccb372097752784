// Device queries the backends size their kernels with.
#include <cuda_runtime.h>

#include "runtime/error_check.h"
#include "runtime/runtime.h"

namespace moe_ep::runtime {

int sm_count(int device) {
  int count = 0;
  MOE_EP_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

}  // namespace moe_ep::runtime
