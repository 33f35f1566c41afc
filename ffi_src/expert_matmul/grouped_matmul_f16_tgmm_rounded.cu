// grouped_matmul's CUTLASS grouped GEMM for f16, mode kTgmmRounded (lhs^T @ rhs per group, rounded; see grouped_matmul.h).
#include "grouped_matmul_impl.cuh"

MOELORA_GROUPED_MATMUL_INSTANTIATE(moelora::DType::kF16, moelora::kTgmmRounded, kGroupedMatmulF16TgmmRounded)
