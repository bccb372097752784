// NVSHMEM versions: the headers this module was compiled against (its statically linked device
// library) and the host library loaded at run time. moe_ep.comm._native refuses to run when they differ.
#include <nvshmem_host.h>

#include "runtime/runtime.h"

namespace moe_ep::runtime {

Version build_version() {
  return {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION};
}

Version runtime_version() {
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  return {major, minor, patch};
}

}  // namespace moe_ep::runtime
