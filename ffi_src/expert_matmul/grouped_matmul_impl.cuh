// grouped_matmul's kernels (grouped_matmul.h): the on-device setup of the
// problems and the zeroing of what no problem writes, then the CUTLASS
// grouped GEMM; instantiated once per dtype and mode (grouped_matmul_<dtype>_<mode>.cu).
#pragma once

#include <algorithm>
#include <cstdint>

#include "grouped_gemm.cuh"
#include "grouped_matmul.h"

namespace moelora::expert_gemm {

// The GemmConfig of each mode (expert_matmul_config.cuh).
template <class T, int64_t Mode> struct ModeConfig;
template <class T> struct ModeConfig<T, kGmm> {
  using type = GemmConfig<T, RowMajor, RowMajor, T, T, Cooperative>;
};
template <class T> struct ModeConfig<T, kGmmRhsT> {
  using type = GemmConfig<T, RowMajor, ColumnMajor, T, T, Cooperative>;
};
template <class T> struct ModeConfig<T, kTgmm> {
  using type = GemmConfig<T, ColumnMajor, RowMajor, void, float, Cooperative, true>;
};
template <class T> struct ModeConfig<T, kTgmmRounded> {
  using type = GemmConfig<T, ColumnMajor, RowMajor, void, T, Cooperative, true>;
};

__device__ inline int64_t clip(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// Group g's rows [lo, hi), clipped into [0, M].
struct Rows {
  int64_t lo, hi;
};
__device__ inline Rows group_rows(const GroupedSet& s, int64_t g) {
  const int64_t lo = clip(s.offsets[g], 0, s.M);
  return {lo, clip(s.offsets[g + 1], lo, s.M)};
}

// The matrix of rhs group g multiplies, or -1 when the group is skipped.
__device__ inline int64_t group_slot(const GroupedSet& s, int64_t g) {
  const int64_t slot = s.slots != nullptr ? int64_t(s.slots[g]) : g;
  return slot >= 0 && slot < s.P ? slot : -1;
}

// The group whose sum output matrix q of a kTgmm* set holds, or -1 (zeros).
__device__ inline int64_t matrix_group(const GroupedSet& s, int64_t q) {
  const int64_t g = s.slots != nullptr ? int64_t(s.slots[q]) : q;
  return g >= 0 && g < s.groups ? g : -1;
}

// Rows of a tgmm output matrix's group (none for a matrix of no group).
__device__ inline Rows matrix_rows(const GroupedSet& s, int64_t q) {
  const int64_t g = matrix_group(s, q);
  return g >= 0 ? group_rows(s, g) : Rows{0, 0};
}

// The set holding unit `u` when set s owns units [first_s + s * extra,
// first_s + s * extra + problems_s + extra).
__device__ inline int set_of(const GroupedMatmulArgs& a, int64_t u, int64_t extra) {
  int s = 0;
  while (s + 1 < a.num_sets && u >= a.sets[s + 1].first + (s + 1) * extra) ++s;
  return s;
}

// Problem j of set s: group j (kGmm*), or output matrix j (kTgmm*), in slot q.
template <class C, int64_t Mode>
__device__ void write_problem(const Problems<C>& p, const GroupedSet& s, int64_t j, int64_t q) {
  using T = typename Problems<C>::T;
  const T* lhs = static_cast<const T*>(s.lhs);
  const T* rhs = static_cast<const T*>(s.rhs);
  const int K = int(s.K), N = int(s.N);
  if constexpr (is_tgmm(Mode)) {
    // (K, N, m): A = lhs rows as a column-major K x m matrix, B = rhs rows.
    const int64_t g = matrix_group(s, j);
    const Rows r = matrix_rows(s, j);
    const int m = int(r.hi - r.lo);
    p.shapes[q] = typename C::Shape{m > 0 ? K : 0, N, m};
    p.ptr_a[q] = lhs + r.lo * K;
    p.ptr_b[q] = rhs + r.lo * N;
    p.ptr_d[q] = static_cast<typename Problems<C>::TD*>(s.out) + j * int64_t(K) * N;
    p.ptr_alpha[q] = s.alpha != nullptr && g >= 0 ? s.alpha + g : p.one;
    p.stride_a[q] = cutlass::make_cute_packed_stride(typename C::StrideA{}, {K, m, 1});
    p.stride_b[q] = cutlass::make_cute_packed_stride(typename C::StrideB{}, {N, m, 1});
    p.stride_d[q] = cutlass::make_cute_packed_stride(typename C::StrideD{}, {K, N, 1});
  } else {
    const int64_t g = j;
    const Rows r = group_rows(s, g);
    const int m = int(r.hi - r.lo);
    const int64_t slot = group_slot(s, g);
    T* out = static_cast<T*>(s.out) + r.lo * N;
    p.shapes[q] = typename C::Shape{slot >= 0 ? m : 0, N, K};
    p.ptr_a[q] = lhs + r.lo * K;
    p.ptr_b[q] = rhs + (slot > 0 ? slot : 0) * K * N;
    p.ptr_c[q] = out;
    p.ptr_d[q] = out;
    p.ptr_alpha[q] = s.alpha != nullptr ? s.alpha + g : p.one;
    p.stride_a[q] = cutlass::make_cute_packed_stride(typename C::StrideA{}, {m, K, 1});
    p.stride_b[q] = cutlass::make_cute_packed_stride(typename C::StrideB{}, {N, K, 1});
    p.stride_c[q] = cutlass::make_cute_packed_stride(typename C::StrideC{}, {m, N, 1});
    p.stride_d[q] = cutlass::make_cute_packed_stride(typename C::StrideD{}, {m, N, 1});
  }
}

// Zeroes `bytes` (a multiple of 16) at `ptr` with the threads of one block.
__device__ inline void zero_bytes(void* ptr, int64_t bytes) {
  uint4* v = static_cast<uint4*>(ptr);
  for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) v[i] = make_uint4(0, 0, 0, 0);
}

// Unit j < problems of a set: output matrix j (kTgmm*) or the rows of group
// j (kGmm*) when no problem writes them; unit `problems` (kGmm* only): the
// rows outside every group.
template <int64_t Mode>
__device__ void zero_unit(const GroupedSet& s, int64_t j, int64_t elem_bytes) {
  const int64_t N = s.N;
  if constexpr (is_tgmm(Mode)) {
    const Rows r = matrix_rows(s, j);
    const int64_t bytes = s.K * N * elem_bytes;
    if (r.hi == r.lo) zero_bytes(static_cast<char*>(s.out) + j * bytes, bytes);
    return;
  } else {
    char* out = static_cast<char*>(s.out);
    const int64_t row = N * elem_bytes;
    if (j < s.groups) {
      const Rows r = group_rows(s, j);
      if (group_slot(s, j) < 0) zero_bytes(out + r.lo * row, (r.hi - r.lo) * row);
      return;
    }
    const int64_t lo = clip(s.offsets[0], 0, s.M);
    const int64_t hi = clip(s.offsets[s.groups], lo, s.M);
    zero_bytes(out, lo * row);
    zero_bytes(out + hi * row, (s.M - hi) * row);
  }
}

// Block 0 writes the problems; blocks 1.. zero what no problem writes (none
// when the outputs accumulate: they keep acc).
template <class C, int64_t Mode>
__global__ void __launch_bounds__(256) setup_grouped(Problems<C> p, GroupedMatmulArgs a) {
  if (blockIdx.x == 0) {
    if constexpr (C::kAlphaArray) {
      if (threadIdx.x == 0) *p.one = 1.0f;
    }
    for (int64_t q = threadIdx.x; q < a.total_problems; q += blockDim.x) {
      const int s = set_of(a, q, 0);
      write_problem<C, Mode>(p, a.sets[s], q - a.sets[s].first, q);
    }
    return;
  }
  constexpr int64_t extra = is_tgmm(Mode) ? 0 : 1;
  const int64_t units = a.total_problems + extra * a.num_sets;
  for (int64_t u = blockIdx.x - 1; u < units; u += gridDim.x - 1) {
    const int s = set_of(a, u, extra);
    zero_unit<Mode>(a.sets[s], u - a.sets[s].first - s * extra,
                    int64_t(sizeof(typename Problems<C>::TD)));
  }
}

template <DType D, int64_t Mode>
using ConfigOf = typename ModeConfig<typename ElementOf<D>::type, Mode>::type;

template <DType D, int64_t Mode>
int64_t grouped_scratch_bytes(int64_t groups, int sm_count) {
  return scratch_layout<ConfigOf<D, Mode>>(groups, sm_count).total;
}

template <DType D, int64_t Mode>
cudaError_t grouped_run(const GroupedMatmulArgs& a, cudaStream_t stream) {
  using C = ConfigOf<D, Mode>;
  if (a.sm_count <= 0 || a.total_problems <= 0) return cudaErrorInvalidValue;
  const ScratchLayout l = scratch_layout<C>(a.total_problems, a.sm_count);
  if (a.scratch_bytes < l.total) return cudaErrorInvalidValue;
  const Problems<C> p = problems_in<C>(a.scratch, l);
  const bool zeroing = is_tgmm(Mode) || !a.acc;
  const int64_t units = a.total_problems + (is_tgmm(Mode) ? 0 : a.num_sets);
  const int64_t zero_blocks = zeroing ? std::min<int64_t>(units, int64_t(a.sm_count) * 4) : 0;
  setup_grouped<C, Mode><<<unsigned(1 + zero_blocks), 256, 0, stream>>>(p, a);
  if (cudaError_t err = cudaPeekAtLastError(); err != cudaSuccess) return err;
  if (cudaError_t err = run_grouped_gemm<C>(p, a.total_problems, a.sm_count, a.acc ? 1.0f : 0.0f,
                                            a.scratch, l, stream);
      err != cudaSuccess)
    return err;
  // For initcheck: every output element is written (by the GEMM's TMA
  // stores, the setup kernel's zeroing, or before the call for acc).
  for (int64_t s = 0; s < a.num_sets; ++s) {
    const GroupedSet& st = a.sets[s];
    const int64_t bytes = (is_tgmm(Mode) ? st.problems * st.K : st.M) * st.N *
                          int64_t(sizeof(typename Problems<C>::TD));
    mark_initialized(st.out, size_t(bytes), stream);
  }
  return cudaPeekAtLastError();
}

}  // namespace moelora::expert_gemm

// The kernel table entry `name` of grouped_matmul.h for dtype D and mode M.
#define MOELORA_GROUPED_MATMUL_INSTANTIATE(D, M, name)                                      \
  namespace moelora {                                                                      \
  const GroupedMatmulKernel name{&expert_gemm::grouped_scratch_bytes<D, M>,                 \
                                 &expert_gemm::grouped_run<D, M>};                          \
  }
