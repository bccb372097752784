// Host-side runtime of moe_ep.comm._C: NVSHMEM bootstrap, the symmetric heap, the host-mapped error state
// that kernels report timeouts into, and device queries. Bound to Python by runtime_bindings.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace moe_ep::runtime {

using Version = std::tuple<int, int, int>;  // major, minor, patch

// bootstrap.cpp
std::string unique_id();  // the raw bytes of a fresh nvshmemx_uniqueid_t
void init(const std::string& unique_id, int rank, int nranks, int device, size_t heap_bytes);
void finalize();
bool is_initialized();
void require_initialized(const char* what);  // throws unless NVSHMEM is initialised
int my_pe();
int n_pes();

// symmetric_heap.cpp
uintptr_t sym_malloc(size_t nbytes);
void sym_free(uintptr_t ptr);
uintptr_t peer_ptr(uintptr_t ptr, int pe);
void barrier_all();

// versions.cpp
Version build_version();
Version runtime_version();

// error_state.cu
std::pair<uintptr_t, uintptr_t> alloc_error_state();  // (host pointer, device pointer)
void free_error_state(uintptr_t host_ptr);
size_t error_state_bytes();  // sizeof(ErrorState): the host mirror (moe_ep/comm/errors.py) checks it
// (name, offset, size) of every ErrorState field, in order: the host mirror checks each one
std::vector<std::tuple<std::string, size_t, size_t>> error_state_fields();
std::vector<std::string> phase_names();

// device_info.cpp
int sm_count(int device);

}  // namespace moe_ep::runtime
