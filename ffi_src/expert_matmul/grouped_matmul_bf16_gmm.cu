// grouped_matmul's CUTLASS grouped GEMM for bf16, mode kGmm (lhs @ rhs[slot]; see grouped_matmul.h).
#include "grouped_matmul_impl.cuh"

MOELORA_GROUPED_MATMUL_INSTANTIATE(moelora::DType::kBf16, moelora::kGmm, kGroupedMatmulBf16Gmm)
