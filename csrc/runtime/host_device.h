// MOE_EP_HOST_DEVICE marks a function of a plain C++ header (one that host-only translation units, such as
// the pybind11 bindings, include) that device code calls too: __host__ __device__ where the translation unit
// is CUDA (__CUDACC__), nothing in plain C++.
#pragma once

#if defined(__CUDACC__)
#define MOE_EP_HOST_DEVICE __host__ __device__
#else
#define MOE_EP_HOST_DEVICE
#endif
