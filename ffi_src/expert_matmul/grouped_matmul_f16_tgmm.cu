// grouped_matmul's CUTLASS grouped GEMM for f16, mode kTgmm (lhs^T @ rhs per group; see grouped_matmul.h).
#include "grouped_matmul_impl.cuh"

MOELORA_GROUPED_MATMUL_INSTANTIATE(moelora::DType::kF16, moelora::kTgmm, kGroupedMatmulF16Tgmm)
