// The Cooperative128 kernel of the FP8 grouped GEMM (fp8_grouped_gemm_sm90.cuh), in a translation unit of its own.
#include "gemm/fp8_grouped_gemm_sm90.cuh"

MOE_EP_SM90_GEMM_ENTRY_POINTS(cooperative128, Cooperative128, GroupedGemmArgs)
