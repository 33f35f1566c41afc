// The second operand pair of expert_matmul's LoRA-in-the-K-loop kernels
// (lora_k_mainloop.cuh), made by the handler before the GEMM for one weight
// set and its route (L = num_loras table rows, rank R, ext_k = L * R):
//
//   xa_ext [M, ext_k]: row r's round(x[r] . A^T) in the R columns of its
//     table row l (the fast grouped fold's shrink, prefill_shrink.cu, writing
//     to column l * R of a row ext_k wide; gate and up in one pass over x);
//     zero where the row folds nothing and in the other adapters' columns.
//   b_ext [e_eff, ext_k, N]: expert e's rows l * R + r hold
//     round(scale[l, e] * b_pool[b_table[l, e]][:, r]), the rows of pairs that
//     resolve_pair rejects are zero. e_eff = min(n_experts, E); experts with
//     no rows are not written (the GEMM has no tile to read them).
//
// So row r of expert e gains sum_k xa_ext[r, k] b_ext[e, k, :] =
// round(x A^T) . round(scale B^T) of its own pair and zeros: the grouped
// fold's delta with the scale applied to B before the product.
#include <algorithm>

#include "expert_matmul.h"
#include "fast/fast_common.cuh"

namespace moelora {
namespace {

constexpr int kPackThreads = 256;

// Block (x: a chunk of kPackThreads columns, y: table row l, z: expert e);
// thread n reads b_pool[b][n][0:R] (R / 8 16-byte loads, R % 8 == 0) and
// writes column n of the R rows of its block (coalesced over n).
// Experts without rows are left unwritten: the GEMM has no tile there.
template <DType D>
__global__ void __launch_bounds__(kPackThreads)
    pack_b_ext(const uint16_t* b_pool, RouteView route, const int32_t* offsets, int64_t N, int R,
               uint16_t* b_ext) {
  const int64_t n = int64_t(blockIdx.x) * kPackThreads + threadIdx.x;
  const int64_t e = blockIdx.z, ext_k = route.num_loras * R;
  if (n >= N || offsets[e + 1] <= offsets[e]) return;
  const int l = int(blockIdx.y);
  Pair pair;
  const bool folds = resolve_pair(route, l, e, &pair);
  uint16_t* dst = b_ext + (e * ext_k + int64_t(l) * R) * N + n;
  const uint16_t* src = b_pool + (int64_t(folds ? pair.b : 0) * N + n) * R;
  for (int r0 = 0; r0 < R; r0 += 8) {
    uint4 v = make_uint4(0, 0, 0, 0);
    if (folds) v = *reinterpret_cast<const uint4*>(src + r0);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      dst[int64_t(r0 + j) * N] = folds ? fast::f2h<D>(pair.scale * fast::h2f<D>(h[j])) : uint16_t(0);
  }
}

}  // namespace

cudaError_t pack_lora_ext(const GroupedArgs& f, void* b_ext, cudaStream_t stream) {
  const int64_t ext_k = f.route.num_loras * f.R;
  if (f.xa_ld != ext_k || !f.xa_by_adapter) return cudaErrorInvalidValue;
  if (cudaError_t err = cudaMemsetAsync(f.xa, 0, size_t(f.te * ext_k) * 2, stream);
      err != cudaSuccess)
    return err;
  const int64_t e_eff = std::min<int64_t>(f.route.n_experts, f.num_experts);
  if (e_eff <= 0 || f.te <= 0) return cudaSuccess;
  const dim3 grid(unsigned((f.N + kPackThreads - 1) / kPackThreads), unsigned(f.route.num_loras),
                  unsigned(e_eff));
  const auto* b_pool = static_cast<const uint16_t*>(f.b_pool);
  auto* b = static_cast<uint16_t*>(b_ext);
  if (f.dtype == DType::kBf16)
    pack_b_ext<DType::kBf16><<<grid, kPackThreads, 0, stream>>>(b_pool, f.route, f.expert_offsets,
                                                                  f.N, int(f.R), b);
  else
    pack_b_ext<DType::kF16><<<grid, kPackThreads, 0, stream>>>(b_pool, f.route, f.expert_offsets,
                                                                 f.N, int(f.R), b);
  return cudaPeekAtLastError();
}

cudaError_t shrink_lora_ext(const GroupedArgs& f, cudaStream_t stream) {
  const int64_t lo = std::max<int64_t>(0, f.row_offset), hi = std::min<int64_t>(f.row_end, f.te);
  if (hi <= lo || std::min<int64_t>(f.route.n_experts, f.num_experts) <= 0) return cudaSuccess;
  return fast::launch_grouped_shrink(f, stream);
}

}  // namespace moelora
