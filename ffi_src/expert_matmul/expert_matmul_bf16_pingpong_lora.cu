// expert_matmul's CUTLASS grouped GEMM for bf16, pingpong schedule, with the LoRA
// delta in its K loop (see expert_matmul_config.cuh, lora_k_mainloop.cuh).
#include "expert_matmul_impl.cuh"

MOELORA_EXPERT_GEMM_INSTANTIATE(LoraConfig, moelora::DType::kBf16, Pingpong, kExpertGemmBf16PingpongLora)
