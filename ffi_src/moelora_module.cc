// The nanobind module jax_moelora._moelora: FFI handler capsules per platform
// and the constants Python must share with the kernels.
#include <nanobind/nanobind.h>

#include "moelora_constants.h"
#include "moelora_handlers.h"

namespace nb = nanobind;

namespace {

nb::capsule capsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_moelora, m) {
  m.doc() = "XLA FFI handlers of jax_moelora (C++ for cpu, CUDA when built).";

  m.def("registrations", []() {
    nb::dict platforms;
    nb::dict cpu;
    cpu[moelora::kGatherBgmvTarget] = capsule(MoeLoraGatherBgmvCpu);
    cpu[moelora::kGroupedDownTarget] = capsule(MoeLoraGroupedDownCpu);
    platforms["cpu"] = cpu;
#ifdef MOELORA_WITH_CUDA
    nb::dict cuda;
    cuda[moelora::kGatherBgmvTarget] = capsule(MoeLoraGatherBgmvCuda);
    cuda[moelora::kGroupedDownTarget] = capsule(MoeLoraGroupedDownCuda);
#ifdef MOELORA_WITH_EXPERT_MATMUL
    cuda[moelora::kExpertMatmulTarget] = capsule(ExpertMatmulCuda);
    cuda[moelora::kGroupedMatmulTarget] = capsule(GroupedMatmulCuda);
#endif
    platforms["CUDA"] = cuda;
#endif
    return platforms;
  });

  m.attr("MLG_M_TILE") = moelora::kMlgMTile;
  m.attr("GBGMV_THREADS") = moelora::kGbgmvThreads;
  m.attr("GBGMV_N_PER_BLOCK") = moelora::kGbgmvNPerBlock;
  m.attr("GBGMV_THREADS_PER_OUTPUT") = moelora::kGbgmvThreadsPerOutput;
  m.attr("RANK_ALIGN") = moelora::kRankAlign;
  m.attr("MAX_RANK") = moelora::kMaxRank;
  m.attr("VARIANT_SIMPLE") = static_cast<int>(moelora::kVariantSimple);
  m.attr("VARIANT_FAST") = static_cast<int>(moelora::kVariantFast);
  m.attr("X_ROWS") = static_cast<int>(moelora::kXRows);
  m.attr("X_TOKENS") = static_cast<int>(moelora::kXTokens);
  m.attr("X_DENSE") = static_cast<int>(moelora::kXDense);
  m.attr("GATHER_BGMV_TARGET") = moelora::kGatherBgmvTarget;
  m.attr("GROUPED_DOWN_TARGET") = moelora::kGroupedDownTarget;
  m.attr("EXPERT_MATMUL_TARGET") = moelora::kExpertMatmulTarget;
  m.attr("EXPERT_MATMUL_ALIGN") = moelora::kExpertMatmulAlign;
  m.attr("EXPERT_MATMUL_SCRATCH_ALIGN") = moelora::kExpertMatmulScratchAlign;
  m.attr("EXPERT_MATMUL_MAX_WEIGHTS") = moelora::kExpertMatmulMaxWeights;
  m.attr("EXPERT_MATMUL_COOPERATIVE") = static_cast<int>(moelora::kExpertMatmulCooperative);
  m.attr("EXPERT_MATMUL_PINGPONG") = static_cast<int>(moelora::kExpertMatmulPingpong);
  m.attr("GROUPED_MATMUL_TARGET") = moelora::kGroupedMatmulTarget;
  m.attr("GROUPED_MATMUL_MAX_SETS") = moelora::kGroupedMatmulMaxSets;
  m.attr("GMM") = static_cast<int>(moelora::kGmm);
  m.attr("GMM_RHS_T") = static_cast<int>(moelora::kGmmRhsT);
  m.attr("TGMM") = static_cast<int>(moelora::kTgmm);
  m.attr("TGMM_ROUNDED") = static_cast<int>(moelora::kTgmmRounded);
  m.def("lora_ext_scratch_bytes", &moelora::lora_ext_scratch_bytes, nb::arg("num_loras"),
        nb::arg("n_experts"), nb::arg("num_experts"), nb::arg("rank"), nb::arg("n"),
        "Bytes of expert_matmul's scratch, after the GEMM's, for one route folded inside "
        "the GEMM: its packed B [min(n_experts, num_experts), num_loras * rank, n] and the "
        "marks of its pairs.");
#ifdef MOELORA_WITH_EXPERT_MATMUL
  m.attr("HAS_EXPERT_MATMUL") = true;
  m.def("expert_matmul_scratch_bytes", &moelora::expert_matmul_scratch_bytes,
        nb::arg("num_groups"), nb::arg("sm_count"),
        "Bytes of expert_matmul's scratch buffer for num_groups GEMM problems on a device "
        "with sm_count SMs (pointer and shape arrays, then CUTLASS's workspace).");
  m.def("grouped_matmul_scratch_bytes", &moelora::grouped_matmul_scratch_bytes,
        nb::arg("mode"), nb::arg("num_problems"), nb::arg("sm_count"),
        "Bytes of grouped_matmul's scratch buffer for a call of `mode` with num_problems "
        "problems (groups, or output matrices of a tgmm) on a device with sm_count SMs.");
  m.def("cuda_sm_count", &moelora::cuda_sm_count, nb::arg("device"),
        "SMs of a CUDA device (0 when it cannot be queried).");
#else
  m.attr("HAS_EXPERT_MATMUL") = false;
#endif
  m.attr("XLA_FFI_API_VERSION") =
      nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef MOELORA_WITH_CUDA
  m.attr("HAS_CUDA") = true;
  m.attr("CUDA_MLG_M_TILE") = moelora::cuda_compiled_mlg_m_tile();
  m.attr("CUDA_ARCHITECTURES") = moelora::cuda_architectures();
#else
  m.attr("HAS_CUDA") = false;
  m.attr("CUDA_MLG_M_TILE") = nb::none();
  m.attr("CUDA_ARCHITECTURES") = nb::none();
#endif
}
