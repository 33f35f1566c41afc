// expert_matmul's grouped GEMM with the LoRA epilogue for bf16 (see expert_matmul_lora.cuh).
#include "expert_matmul_lora.cuh"

MOELORA_EXPERT_GEMM_LORA_INSTANTIATE(moelora::DType::kBf16, bf16)
