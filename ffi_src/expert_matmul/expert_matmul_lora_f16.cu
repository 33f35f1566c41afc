// expert_matmul's grouped GEMM with the LoRA epilogue for f16 (see expert_matmul_lora.cuh).
#include "expert_matmul_lora.cuh"

MOELORA_EXPERT_GEMM_LORA_INSTANTIATE(moelora::DType::kF16, f16)
