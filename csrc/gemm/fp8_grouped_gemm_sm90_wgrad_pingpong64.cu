// The WgradPingpong64 kernel of the FP8 weight-gradient GEMM (K-grouped: fp8_grouped_gemm.h's wgrad_gemm; the
// kernel templates, table and zeroing kernels: fp8_grouped_gemm_sm90.cuh, group_tables.cuh), in a translation unit
// of its own. Runs on sm_90a; relies on the placement fp8_grouped_gemm.h's WgradGemmArgs states.
#include "gemm/fp8_grouped_gemm_sm90.cuh"

MOE_EP_SM90_GEMM_ENTRY_POINTS(wgrad_pingpong64, WgradPingpong64, WgradGemmArgs)
