// expert_matmul's grouped GEMM: the on-device setup kernel and the CUTLASS
// launch, instantiated once per dtype and schedule (expert_matmul_<dtype>_<schedule>.cu).
#pragma once

#include <algorithm>
#include <cstdint>

#include "expert_matmul.h"
#include "grouped_gemm.cuh"

namespace moelora::expert_gemm {

// Block 0 writes one problem per (weight set, expert): rows
// [offsets[e], offsets[e + 1]) of x and of that weight set's output, w[e]
// (with a kLoraK config, and where the weight set has an extension for e:
// where its rows of xa_ext start and its expert in b_ext, K split as
// lora_k_mainloop.cuh says).
// The other blocks zero the output rows past offsets[E] (16-byte stores;
// N is a multiple of 8 elements).
template <class C>
__global__ void __launch_bounds__(256) setup_problems(Problems<C> p, ExpertGemmArgs a) {
  using T = typename Problems<C>::T;
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
      if constexpr (C::kLoraK) {
        const bool ext = a.xa_ext[wi] != nullptr && e < a.ext_experts[wi];
        const int kx = ext ? int(a.ext_k[wi]) : 0;
        constexpr int kBlkK = cute::size<2>(TileShape{});
        p.lora_k[g] = LoraK{int(K), kx, int(lo), int(e), int(wi)};
        if (ext) p.shapes[g] = typename C::Shape{m, int(N), int((K + kBlkK - 1) / kBlkK * kBlkK + kx)};
      }
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

template <class C>
int64_t scratch_bytes(int64_t groups, int sm_count) {
  return scratch_layout<C>(groups, sm_count).total;
}

template <class C>
cudaError_t run(const ExpertGemmArgs& a, cudaStream_t stream) {
  const int64_t groups = a.num_weights * a.E;
  if (a.sm_count <= 0) return cudaErrorInvalidValue;
  const ScratchLayout l = scratch_layout<C>(groups, a.sm_count);
  if (a.scratch_bytes < l.total) return cudaErrorInvalidValue;
  const Problems<C> p = problems_in<C>(a.scratch, l);
  constexpr int kThreads = 256;
  const int64_t vectors = a.M * a.N / (16 / int64_t(sizeof(typename Problems<C>::T)));
  const int64_t zero_blocks =
      std::min<int64_t>((vectors + kThreads - 1) / kThreads, int64_t(a.sm_count) * 4);
  setup_problems<C><<<unsigned(1 + std::max<int64_t>(zero_blocks, 1)), kThreads, 0, stream>>>(p, a);
  if (cudaError_t err = cudaPeekAtLastError(); err != cudaSuccess) return err;
  LoraExt ext;
  for (int64_t wi = 0; wi < a.num_weights && C::kLoraK; ++wi) {
    if (a.xa_ext[wi] == nullptr) continue;
    ext.a[wi] = a.xa_ext[wi];
    ext.b[wi] = a.b_ext[wi];
    ext.rows[wi] = int32_t(a.M);
    ext.k_ext[wi] = int32_t(a.ext_k[wi]);
    ext.experts[wi] = int32_t(a.ext_experts[wi]);
  }
  ext.n = int32_t(a.N);
  if (cudaError_t err = run_grouped_gemm<C>(p, groups, a.sm_count, 0.0f, a.scratch, l, stream, ext);
      err != cudaSuccess)
    return err;
  // For initcheck: every output row is written (rows below offsets[E] by the
  // GEMM's TMA stores, the rest zeroed above).
  for (int64_t wi = 0; wi < a.num_weights; ++wi)
    mark_initialized(a.out[wi], size_t(a.M * a.N) * sizeof(typename Problems<C>::T), stream);
  return cudaPeekAtLastError();
}

}  // namespace moelora::expert_gemm

// The kernel table entry `name` of expert_matmul.h: config template Cfg
// (Config or LoraConfig) for dtype D and schedule S.
#define MOELORA_EXPERT_GEMM_INSTANTIATE(Cfg, D, S, name)                                    \
  namespace moelora {                                                                     \
  using name##_config = expert_gemm::Cfg<expert_gemm::ElementOf<D>::type, expert_gemm::S>; \
  const ExpertGemmKernel name{&expert_gemm::scratch_bytes<name##_config>,                  \
                              &expert_gemm::run<name##_config>};                           \
  }
