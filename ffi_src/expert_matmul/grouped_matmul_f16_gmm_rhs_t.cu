// grouped_matmul's CUTLASS grouped GEMM for f16, mode kGmmRhsT (lhs @ rhs[slot]^T; see grouped_matmul.h).
#include "grouped_matmul_impl.cuh"

MOELORA_GROUPED_MATMUL_INSTANTIATE(moelora::DType::kF16, moelora::kGmmRhsT, kGroupedMatmulF16GmmRhsT)
