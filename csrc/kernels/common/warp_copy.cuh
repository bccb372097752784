// The row copies of every normal-mode kernel (NVLink and cross-node): one warp moves a row with all
// of a lane's loads in flight before any store, to one or several destinations.
#pragma once
#include <cuda_runtime.h>

namespace moe_ep {

// 16-byte load of data that stays constant during the kernel (kernel inputs): skips L1.
__device__ __forceinline__ int4 ld_nc_int4(const int4* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

struct Unchanged {
  template <class T>
  __device__ __forceinline__ T operator()(const T& v) const { return v; }
};

// The row copy of every normal-mode kernel: one warp copies src[0, count) to dst_of(d) for every bit
// d of `dests`. Per step each lane issues all its kU loads (`load`: LoadNc for kernel inputs, LoadCg
// for data another GPU or the NIC wrote) before any store, and each element is loaded once
// whatever the number of destinations; `change` maps each element before its stores (the combine's
// one-source rounding; a plain copy by default). T: a 4-, 8- or 16-byte type; `dests` must be
// warp-uniform.
template <int kU, class T, class Load, class DstOf, class Change = Unchanged>
__device__ __forceinline__ void warp_copy(const T* src, int count, int lane, Load load, unsigned dests,
                                          DstOf dst_of, Change change = {}) {
  for (int first = 0; first < count; first += 32 * kU) {
    T v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = first + u * 32 + lane;
      if (i < count) v[u] = load(src + i);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) v[u] = change(v[u]);  // after every load of the step was issued
    for (unsigned m = dests; m != 0; m &= m - 1) {
      T* dst = dst_of(__ffs(m) - 1);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = first + u * 32 + lane;
        if (i < count) dst[i] = v[u];
      }
    }
  }
}

struct LoadNc {
  __device__ __forceinline__ int4 operator()(const int4* p) const { return ld_nc_int4(p); }
};

struct LoadCg {  // through L2 (ld.cg): data another GPU wrote, already acquired
  template <class T>
  __device__ __forceinline__ T operator()(const T* p) const { return __ldcg(p); }
};

// dst[i] = src[i] for i < count, by one warp (warp_copy with one destination, src read by ld.cg).
template <int kU, class T>
__device__ __forceinline__ void warp_copy_cg(T* dst, const T* src, int count, int lane) {
  warp_copy<kU>(src, count, lane, LoadCg{}, 1u, [dst](int) { return dst; });
}

}  // namespace moe_ep
