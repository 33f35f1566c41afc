// expert_matmul's grouped GEMM: the on-device setup kernel and the CUTLASS
// launch, instantiated once per dtype and schedule (expert_matmul_<dtype>_<schedule>.cu).
#pragma once

#include <algorithm>
#include <cstdint>

#include "expert_matmul.h"
#include "expert_matmul_config.cuh"
#include "sanitizer_marks.h"

namespace moelora::expert_gemm {

template <DType D> struct ElementOf;
template <> struct ElementOf<DType::kBf16> { using type = cutlass::bfloat16_t; };
template <> struct ElementOf<DType::kF16> { using type = cutlass::half_t; };

inline int64_t align_up(int64_t v) {
  return (v + kExpertMatmulScratchAlign - 1) / kExpertMatmulScratchAlign * kExpertMatmulScratchAlign;
}

// Byte offsets of the arrays carved out of the scratch buffer.
struct ScratchLayout {
  int64_t shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, workspace, total;
};

template <class C>
ScratchLayout scratch_layout(int64_t groups, int64_t workspace_bytes) {
  ScratchLayout l{};
  int64_t at = 0;
  auto take = [&](int64_t bytes) { const int64_t here = at; at = align_up(at + bytes); return here; };
  l.shapes = take(groups * int64_t(sizeof(typename C::Shape)));
  l.ptr_a = take(groups * int64_t(sizeof(void*)));
  l.ptr_b = take(groups * int64_t(sizeof(void*)));
  l.ptr_d = take(groups * int64_t(sizeof(void*)));
  l.stride_a = take(groups * int64_t(sizeof(typename C::StrideA)));
  l.stride_b = take(groups * int64_t(sizeof(typename C::StrideB)));
  l.stride_d = take(groups * int64_t(sizeof(typename C::StrideD)));
  l.workspace = take(workspace_bytes);
  l.total = at;
  return l;
}

// The device arrays of one launch (typed views into the scratch buffer).
template <class C, class T>
struct Problems {
  typename C::Shape* shapes;
  const T** ptr_a;
  const T** ptr_b;
  T** ptr_d;
  typename C::StrideA* stride_a;
  typename C::StrideB* stride_b;
  typename C::StrideD* stride_d;
};

template <class C, class T>
typename C::Gemm::Arguments gemm_arguments(const Problems<C, T>& p, int64_t groups, int sm_count) {
  using Gemm = typename C::Gemm;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;  // read only when sm_count <= 0, which the handler rejects
  hw.sm_count = sm_count;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {int(groups), p.shapes, nullptr},  // device shapes only: no host copy
      {p.ptr_a, p.stride_a, p.ptr_b, p.stride_b},
      {{}, nullptr, nullptr, p.ptr_d, p.stride_d},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

// Block 0 writes one problem per (weight set, expert): rows
// [offsets[e], offsets[e + 1]) of x and of that weight set's output, w[e].
// The other blocks zero the output rows past offsets[E] (16-byte stores;
// N is a multiple of 8 elements).
template <class C, class T>
__global__ void __launch_bounds__(256) setup_problems(Problems<C, T> p, ExpertGemmArgs a) {
  const int64_t E = a.E, K = a.K, N = a.N;
  if (blockIdx.x == 0) {
    for (int64_t g = threadIdx.x; g < a.num_weights * E; g += blockDim.x) {
      const int64_t wi = g / E, e = g % E;
      const int64_t lo = a.offsets[e], hi = a.offsets[e + 1];
      const int m = int(hi > lo ? hi - lo : 0);
      p.shapes[g] = typename C::Shape{m, int(N), int(K)};
      p.ptr_a[g] = static_cast<const T*>(a.x) + lo * K;
      p.ptr_b[g] = static_cast<const T*>(a.w[wi]) + e * K * N;
      p.ptr_d[g] = static_cast<T*>(a.out[wi]) + lo * N;
      p.stride_a[g] = cutlass::make_cute_packed_stride(typename C::StrideA{}, {m, int(K), 1});
      p.stride_b[g] = cutlass::make_cute_packed_stride(typename C::StrideB{}, {int(N), int(K), 1});
      p.stride_d[g] = cutlass::make_cute_packed_stride(typename C::StrideD{}, {m, int(N), 1});
    }
    return;
  }
  constexpr int64_t kVec = 16 / sizeof(T);
  const int64_t vectors = a.M * N / kVec;
  const int64_t first = int64_t(a.offsets[E]) * N / kVec;
  const int64_t step = int64_t(gridDim.x - 1) * blockDim.x;
  for (int64_t wi = 0; wi < a.num_weights; ++wi) {
    uint4* out = static_cast<uint4*>(a.out[wi]);
    for (int64_t v = first + int64_t(blockIdx.x - 1) * blockDim.x + threadIdx.x; v < vectors;
         v += step)
      out[v] = make_uint4(0, 0, 0, 0);
  }
}

template <DType D, class S>
int64_t scratch_bytes(int64_t groups, int sm_count) {
  using T = typename ElementOf<D>::type;
  using C = Config<T, S>;
  Problems<C, T> none{};
  const auto args = gemm_arguments<C, T>(none, groups, sm_count);
  return scratch_layout<C>(groups, int64_t(C::Gemm::get_workspace_size(args))).total;
}

template <DType D, class S>
cudaError_t run(const ExpertGemmArgs& a, cudaStream_t stream) {
  using T = typename ElementOf<D>::type;
  using C = Config<T, S>;
  const int64_t groups = a.num_weights * a.E;
  Problems<C, T> none{};
  const int64_t workspace_bytes =
      int64_t(C::Gemm::get_workspace_size(gemm_arguments<C, T>(none, groups, a.sm_count)));
  const ScratchLayout l = scratch_layout<C>(groups, workspace_bytes);
  if (a.sm_count <= 0 || a.scratch_bytes < l.total) return cudaErrorInvalidValue;
  char* base = static_cast<char*>(a.scratch);
  Problems<C, T> p{reinterpret_cast<typename C::Shape*>(base + l.shapes),
                   reinterpret_cast<const T**>(base + l.ptr_a),
                   reinterpret_cast<const T**>(base + l.ptr_b),
                   reinterpret_cast<T**>(base + l.ptr_d),
                   reinterpret_cast<typename C::StrideA*>(base + l.stride_a),
                   reinterpret_cast<typename C::StrideB*>(base + l.stride_b),
                   reinterpret_cast<typename C::StrideD*>(base + l.stride_d)};
  constexpr int kThreads = 256;
  const int64_t vectors = a.M * a.N / (16 / int64_t(sizeof(T)));
  const int64_t zero_blocks =
      std::min<int64_t>((vectors + kThreads - 1) / kThreads, int64_t(a.sm_count) * 4);
  setup_problems<C, T><<<unsigned(1 + std::max<int64_t>(zero_blocks, 1)), kThreads, 0, stream>>>(p, a);
  if (cudaError_t err = cudaPeekAtLastError(); err != cudaSuccess) return err;

  typename C::Gemm gemm;
  const auto args = gemm_arguments<C, T>(p, groups, a.sm_count);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(args, base + l.workspace, stream) != cutlass::Status::kSuccess)
    return cudaErrorInvalidConfiguration;
  // For initcheck (sanitizer_marks.h): the CTAs' tensor-map copies into the
  // workspace are writes, and after the GEMM every output row is written
  // (rows below offsets[E] by its TMA stores, the rest zeroed above).
  mark_initialized(base + l.workspace, size_t(workspace_bytes), stream);
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaPeekAtLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  for (int64_t wi = 0; wi < a.num_weights; ++wi)
    mark_initialized(a.out[wi], size_t(a.M * a.N) * sizeof(T), stream);
  return cudaPeekAtLastError();
}

}  // namespace moelora::expert_gemm

// The kernel table entry `name` of expert_matmul.h for dtype D and schedule S.
#define MOELORA_EXPERT_GEMM_INSTANTIATE(D, S, name)                                        \
  namespace moelora {                                                                     \
  const ExpertGemmKernel name{&expert_gemm::scratch_bytes<D, expert_gemm::S>,              \
                              &expert_gemm::run<D, expert_gemm::S>};                       \
  }
