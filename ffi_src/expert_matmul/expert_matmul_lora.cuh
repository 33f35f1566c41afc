// expert_matmul's grouped GEMM with the LoRA expand in its epilogue
// (lora_epilogue.cuh), instantiated once per dtype (expert_matmul_lora_bf16.cu,
// _f16.cu).
#pragma once

#include "expert_matmul_impl.cuh"
#include "lora_epilogue.cuh"

namespace moelora::expert_gemm {

template <DType D>
using LoraConfig = ConfigWith<typename ElementOf<D>::type, LoraEpilogue<D>>;

template <DType D>
int64_t lora_scratch_bytes(int64_t groups, int sm_count) {
  return scratch_bytes_of<LoraConfig<D>, typename ElementOf<D>::type>(groups, sm_count,
                                                                      LoraEpilogueArgs{});
}

template <DType D>
cudaError_t lora_run(const ExpertGemmArgs& a, const LoraEpilogueArgs& lora, cudaStream_t stream) {
  return run_with<LoraConfig<D>, typename ElementOf<D>::type>(a, lora, stream);
}

}  // namespace moelora::expert_gemm

// The two per-dtype entry points of the LoRA GEMM for dtype D, named by `suffix`.
#define MOELORA_EXPERT_GEMM_LORA_INSTANTIATE(D, suffix)                                      \
  namespace moelora {                                                                       \
  int64_t expert_gemm_lora_scratch_bytes_##suffix(int64_t groups, int sm_count) {           \
    return expert_gemm::lora_scratch_bytes<D>(groups, sm_count);                            \
  }                                                                                         \
  cudaError_t expert_gemm_lora_run_##suffix(const ExpertGemmArgs& args,                     \
                                            const LoraEpilogueArgs& lora,                   \
                                            cudaStream_t stream) {                          \
    return expert_gemm::lora_run<D>(args, lora, stream);                                    \
  }                                                                                         \
  }
