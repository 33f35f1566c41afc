// The launch of one CUTLASS ptr-array grouped GEMM (a GemmConfig of
// expert_matmul_config.cuh) whose problems a setup kernel of the caller wrote
// into device memory: the scratch layout of the problem arrays and CUTLASS's
// workspace, typed views into it, and the launch itself. No host
// synchronisation, no allocation: every array lives in one scratch buffer the
// custom call receives from XLA.
#pragma once

#include <cstdint>

#include "cuda_common.cuh"
#include "expert_matmul_config.cuh"
#include "moelora_constants.h"
#include "sanitizer_marks.h"

namespace moelora::expert_gemm {

template <DType D> struct ElementOf;
template <> struct ElementOf<DType::kBf16> { using type = cutlass::bfloat16_t; };
template <> struct ElementOf<DType::kF16> { using type = cutlass::half_t; };

// Byte offsets of the arrays carved out of the scratch buffer (ptr_c and
// stride_c are empty for a config without C, the per-group alphas for one
// without kAlphaArray, the per-group LoraK for one without the second operand
// pair, kLoraK).
struct ScratchLayout {
  int64_t shapes, ptr_a, ptr_b, ptr_c, ptr_d, stride_a, stride_b, stride_c, stride_d, ptr_alpha,
      one, lora_k, workspace, total;
};

// The device arrays of one launch (typed views into the scratch buffer).
template <class C>
struct Problems {
  using T = typename C::ElementAB;
  using TC = typename C::ElementC;  // void without C
  using TD = typename C::ElementD;
  typename C::Shape* shapes;
  const T** ptr_a;
  const T** ptr_b;
  const TC** ptr_c;  // nullptr without C
  TD** ptr_d;
  typename C::StrideA* stride_a;
  typename C::StrideB* stride_b;
  typename C::StrideC* stride_c;  // nullptr without C
  typename C::StrideD* stride_d;
  const float** ptr_alpha;  // per-group alpha (D = alpha * acc + beta * C), or nullptr: 1
  float* one;               // a 1.0f for groups without an alpha (nullptr without kAlphaArray)
  // Where each group of a kLoraK config (lora_k_mainloop.cuh) reads its
  // second operand pair, else nullptr.
  LoraK* lora_k;
};

// The second operand pairs of a kLoraK launch, whole, per weight set
// (lora_k_mainloop.cuh's ExtPair): a [rows, k_ext], b [experts, k_ext, n];
// a[s] == nullptr: weight set s has none.
struct LoraExt {
  const void* a[kLoraKMaxSets] = {};
  const void* b[kLoraKMaxSets] = {};
  int32_t rows[kLoraKMaxSets] = {}, k_ext[kLoraKMaxSets] = {}, experts[kLoraKMaxSets] = {};
  int32_t n = 0;
};

// The mainloop's arguments: the operand pointers and strides (and the
// second pairs of a kLoraK config).
template <class C>
typename C::Gemm::GemmKernel::MainloopArguments mainloop_arguments(const Problems<C>& p,
                                                                   const LoraExt& ext) {
  if constexpr (C::kLoraK) {
    using Mainloop = typename C::CollectiveMainloop;
    using T = typename C::ElementAB;
    typename C::Gemm::GemmKernel::MainloopArguments m{p.ptr_a, p.stride_a, p.ptr_b, p.stride_b,
                                                      {}, p.lora_k};
    for (int s = 0; s < kLoraKMaxSets; ++s)
      m.ext[s] = typename Mainloop::ExtPair{static_cast<const T*>(ext.a[s]),
                                            static_cast<const T*>(ext.b[s]), ext.rows[s],
                                            ext.k_ext[s], ext.experts[s], ext.n};
    return m;
  } else {
    return {p.ptr_a, p.stride_a, p.ptr_b, p.stride_b};
  }
}

template <class C>
typename C::Gemm::Arguments gemm_arguments(const Problems<C>& p, int64_t groups, int sm_count,
                                           float beta, const LoraExt& ext = {}) {
  using Gemm = typename C::Gemm;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;  // read only when sm_count <= 0, which the handlers reject
  hw.sm_count = sm_count;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {int(groups), p.shapes, nullptr},  // device shapes only: no host copy
      mainloop_arguments<C>(p, ext),
      {{}, p.ptr_c, p.stride_c, p.ptr_d, p.stride_d},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = beta;
  if constexpr (C::kAlphaArray) args.epilogue.thread.alpha_ptr_array = p.ptr_alpha;
  return args;
}

template <class C>
int64_t workspace_bytes(int64_t groups, int sm_count) {
  Problems<C> none{};
  return int64_t(C::Gemm::get_workspace_size(gemm_arguments<C>(none, groups, sm_count, 0.0f)));
}

template <class C>
ScratchLayout scratch_layout(int64_t groups, int sm_count) {
  ScratchLayout l{};
  int64_t at = 0;
  auto take = [&](int64_t bytes) { const int64_t here = at; at = expert_matmul_scratch_align(at + bytes); return here; };
  const int64_t c_groups = C::kHasC ? groups : 0;
  const int64_t alpha_groups = C::kAlphaArray ? groups : 0;
  l.shapes = take(groups * int64_t(sizeof(typename C::Shape)));
  l.ptr_a = take(groups * int64_t(sizeof(void*)));
  l.ptr_b = take(groups * int64_t(sizeof(void*)));
  l.ptr_c = take(c_groups * int64_t(sizeof(void*)));
  l.ptr_d = take(groups * int64_t(sizeof(void*)));
  l.stride_a = take(groups * int64_t(sizeof(typename C::StrideA)));
  l.stride_b = take(groups * int64_t(sizeof(typename C::StrideB)));
  l.stride_c = take(c_groups * int64_t(sizeof(typename C::StrideC)));
  l.stride_d = take(groups * int64_t(sizeof(typename C::StrideD)));
  l.ptr_alpha = take(alpha_groups * int64_t(sizeof(float*)));
  l.one = take(C::kAlphaArray ? int64_t(sizeof(float)) : 0);
  l.lora_k = take((C::kLoraK ? groups : 0) * int64_t(sizeof(LoraK)));
  l.workspace = take(workspace_bytes<C>(groups, sm_count));
  l.total = at;
  return l;
}

template <class C>
Problems<C> problems_in(void* scratch, const ScratchLayout& l) {
  using P = Problems<C>;
  char* base = static_cast<char*>(scratch);
  return P{reinterpret_cast<typename C::Shape*>(base + l.shapes),
           reinterpret_cast<const typename P::T**>(base + l.ptr_a),
           reinterpret_cast<const typename P::T**>(base + l.ptr_b),
           C::kHasC ? reinterpret_cast<const typename P::TC**>(base + l.ptr_c) : nullptr,
           reinterpret_cast<typename P::TD**>(base + l.ptr_d),
           reinterpret_cast<typename C::StrideA*>(base + l.stride_a),
           reinterpret_cast<typename C::StrideB*>(base + l.stride_b),
           C::kHasC ? reinterpret_cast<typename C::StrideC*>(base + l.stride_c) : nullptr,
           reinterpret_cast<typename C::StrideD*>(base + l.stride_d),
           C::kAlphaArray ? reinterpret_cast<const float**>(base + l.ptr_alpha) : nullptr,
           C::kAlphaArray ? reinterpret_cast<float*>(base + l.one) : nullptr,
           C::kLoraK ? reinterpret_cast<LoraK*>(base + l.lora_k) : nullptr};
}

// Runs the grouped GEMM whose `groups` problems `p` holds (written earlier on
// `stream`), D = alpha_g * acc + beta * C (alpha_g from p.ptr_alpha for a
// config with kAlphaArray, else 1). For initcheck (sanitizer_marks.h) the CTAs'
// tensor-map copies into the workspace count as writes.
template <class C>
cudaError_t run_grouped_gemm(const Problems<C>& p, int64_t groups, int sm_count, float beta,
                             void* scratch, const ScratchLayout& l, cudaStream_t stream,
                             const LoraExt& ext = {}) {
  typename C::Gemm gemm;
  const auto args = gemm_arguments<C>(p, groups, sm_count, beta, ext);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  char* workspace = static_cast<char*>(scratch) + l.workspace;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess)
    return cudaErrorInvalidConfiguration;
  mark_initialized(workspace, size_t(l.total - l.workspace), stream);
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaPeekAtLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaPeekAtLastError();
}

}  // namespace moelora::expert_gemm
