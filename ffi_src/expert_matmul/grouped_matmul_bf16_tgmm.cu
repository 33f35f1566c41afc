// grouped_matmul's CUTLASS grouped GEMM for bf16, mode kTgmm (lhs^T @ rhs per group; see grouped_matmul.h).
#include "grouped_matmul_impl.cuh"

MOELORA_GROUPED_MATMUL_INSTANTIATE(moelora::DType::kBf16, moelora::kTgmm, kGroupedMatmulBf16Tgmm)
