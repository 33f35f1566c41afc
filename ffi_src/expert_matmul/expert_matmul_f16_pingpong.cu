// expert_matmul's CUTLASS grouped GEMM for f16, pingpong schedule (see expert_matmul_config.cuh).
#include "expert_matmul_impl.cuh"

MOELORA_EXPERT_GEMM_INSTANTIATE(Config, moelora::DType::kF16, Pingpong, kExpertGemmF16Pingpong)
