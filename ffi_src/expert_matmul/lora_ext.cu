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
//     no rows are not written (the GEMM has no tile to read them). A caller
//     may pass b_ext and the marks packed beforehand (pack_lora_in_gemm in
//     jax_moelora/ops/lora_pack.py: the same values, made once per adapter
//     change); then only xa_ext is made here.
//
// So row r of expert e gains sum_k xa_ext[r, k] b_ext[e, k, :] =
// round(x A^T) . round(scale B^T) of its own pair and zeros: the grouped
// fold's delta with the scale applied to B before the product.
//
// Every row of expert e multiplies all of b_ext[e], so one value of it that
// is not finite (a NaN or inf in the pool, or scale * B past the dtype's
// range) would turn the other pairs' rows, and the rows that fold nothing,
// into NaN (0 * inf). The pack writes 0 in its place and marks the pair; the
// shrink leaves the marked pairs' rows out of xa_ext, so the GEMM writes
// their base; after the GEMM, fold_marked_rows folds them as the fold after
// the GEMM does, and writes their xa_ext rows, so that after the call xa_ext
// holds every folding row's round(x A^T) (what the backward reads). It
// returns at once when no pair is marked.
#include <algorithm>

#include "expert_matmul.h"
#include "fast/fast_common.cuh"

namespace moelora {
namespace {

constexpr int kPackThreads = 256;
constexpr int kMarkedThreads = 256;
constexpr int kMarkedWarps = kMarkedThreads / 32;

// One weight set's pack: its B pool and route, where its b_ext and marks go.
struct PackSet {
  const uint16_t* b_pool;
  RouteView route;
  uint16_t* b_ext;
  int32_t* marks;
  int64_t e_eff;
  int R;
};
struct PackSets {  // a kernel parameter: every set of the call, one launch
  PackSet set[kExpertMatmulMaxWeights];
  int n;
};

// Block (x: a chunk of kPackThreads columns; y, z: table rows l and experts
// e, strided by the grid), each weight set in turn; thread n reads
// b_pool[b][n][0:R] (R / 8 16-byte loads, R % 8 == 0) and writes column n of
// the R rows of its block (coalesced over n). A value that is not finite is
// written as 0 and marks its pair: marks[l * n_experts + e] and
// marks[L * n_experts] (any). Experts without rows are left unwritten: the
// GEMM has no tile there.
template <DType D>
__global__ void __launch_bounds__(kPackThreads)
    pack_b_ext(const PackSets sets, const int32_t* offsets, int64_t N) {
  const int64_t n = int64_t(blockIdx.x) * kPackThreads + threadIdx.x;
  if (n >= N) return;
  for (int s = 0; s < sets.n; ++s) {
    const PackSet& p = sets.set[s];
    const RouteView& route = p.route;
    const int R = p.R;
    const int64_t ext_k = route.num_loras * R;
    for (int64_t e = blockIdx.z; e < p.e_eff; e += gridDim.z) {
      if (offsets[e + 1] <= offsets[e]) continue;
      for (int64_t l = blockIdx.y; l < route.num_loras; l += gridDim.y) {
        Pair pair;
        const bool folds = resolve_pair(route, l, e, &pair);
        uint16_t* dst = p.b_ext + (e * ext_k + l * R) * N + n;
        const uint16_t* src = p.b_pool + (int64_t(folds ? pair.b : 0) * N + n) * R;
        bool bad = false;
        for (int r0 = 0; r0 < R; r0 += 8) {
          uint4 v = make_uint4(0, 0, 0, 0);
          if (folds) v = *reinterpret_cast<const uint4*>(src + r0);
          const uint16_t* h = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            uint16_t q = folds ? fast::f2h<D>(pair.scale * fast::h2f<D>(h[j])) : uint16_t(0);
            if (!isfinite(fast::h2f<D>(q))) {
              q = 0;
              bad = true;
            }
            dst[int64_t(r0 + j) * N] = q;
          }
        }
        if (bad) {  // every writer stores the same 1
          p.marks[l * route.n_experts + e] = 1;
          p.marks[route.num_loras * route.n_experts] = 1;
        }
      }
    }
  }
}

// Every weight set of the call, one launch (blockIdx.y: the set).
struct MarkedSets {
  GroupedArgs set[kExpertMatmulMaxWeights];
};

// The rows of the pairs a.skip_cells marks (the pack's marks), after the
// GEMM (which wrote their base: the shrink left them out): out = round(base +
// scale * round(round(x A^T) B^T)), the fold after the GEMM, fp32 sums,
// round(x A^T) also stored in the row's R columns of a.xa (rows a.xa_ld wide,
// column l * R), for the sorted rows of the window [row_offset, row_end), a =
// sets.set[blockIdx.y]. One warp a row; every CTA returns at once when no
// pair of its set is marked.
template <DType D>
__global__ void __launch_bounds__(kMarkedThreads)
    fold_marked_rows_kernel(const MarkedSets sets) {
  const GroupedArgs& a = sets.set[blockIdx.y];
  const RouteView& rt = a.route;
  const int32_t* marks = a.skip_cells;
  if (marks[rt.num_loras * rt.n_experts] == 0) return;  // uniform
  __shared__ float s_xa[kMarkedWarps][kMaxRank];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int R = int(a.R);
  const int64_t K = a.K, N = a.N;
  const auto* x = static_cast<const uint16_t*>(a.x);
  const auto* a_pool = static_cast<const uint16_t*>(a.a_pool);
  const auto* b_pool = static_cast<const uint16_t*>(a.b_pool);
  auto* out = static_cast<uint16_t*>(a.out);
  const int64_t hi = a.row_end < a.te ? a.row_end : a.te;
  for (int64_t r = (a.row_offset > 0 ? a.row_offset : 0) + int64_t(blockIdx.x) * kMarkedWarps + w;
       r < hi; r += int64_t(gridDim.x) * kMarkedWarps) {
    const int64_t e = find_expert(a.expert_offsets, a.num_experts, r);
    int64_t tk, ad, orow;
    Pair pair;
    if (e < 0 ||
        !grouped_row_adapter(a.sorted_token_ids, a.row_adapter, a.has_row_adapter, a.num_tokens,
                             a.x_gather, r, &tk, &ad) ||
        !resolve_pair(rt, ad, e, &pair) || !grouped_out_row(a.out_rows, a.m, r, &orow))
      continue;
    const int64_t l = rt.num_loras == 1 ? 0 : ad;
    if (marks[l * rt.n_experts + e] == 0) continue;
    const uint16_t* xr = x + (a.x_gather ? tk : r) * K;
    const uint16_t* A = a_pool + int64_t(pair.a) * R * K;
    uint16_t* xa_row = static_cast<uint16_t*>(a.xa) + r * a.xa_ld + l * R;
    for (int k = 0; k < R; ++k) {
      float s = 0.f;
      for (int64_t j = lane; j < K; j += 32)
        s += fast::h2f<D>(xr[j]) * fast::h2f<D>(A[k * K + j]);
      s = warp_sum(s);
      if (lane == 0) {
        const uint16_t h = fast::f2h<D>(s);
        s_xa[w][k] = fast::h2f<D>(h);
        xa_row[k] = h;
      }
    }
    __syncwarp();
    const uint16_t* B = b_pool + int64_t(pair.b) * N * R;
    uint16_t* o = out + orow * N;
    for (int64_t n = lane; n < N; n += 32) {
      float d = 0.f;
      for (int k = 0; k < R; ++k) d += s_xa[w][k] * fast::h2f<D>(B[n * R + k]);
      o[n] = fast::f2h<D>(fold_add(fast::h2f<D>(o[n]), pair.scale,
                                   fast::h2f<D>(fast::f2h<D>(d))));
    }
    __syncwarp();  // s_xa[w] is rewritten by the warp's next row
  }
}

}  // namespace

cudaError_t pack_lora_ext(const GroupedArgs* folds, void* const* b_ext, int32_t* const* marks,
                          int n_sets, cudaStream_t stream) {
  if (n_sets < 1 || n_sets > kExpertMatmulMaxWeights) return cudaErrorInvalidValue;
  PackSets sets = {};
  sets.n = n_sets;
  int64_t max_l = 1, max_e = 0;
  for (int s = 0; s < n_sets; ++s) {
    const GroupedArgs& f = folds[s];
    const int64_t ext_k = f.route.num_loras * f.R;
    if (f.xa_ld != ext_k || !f.xa_by_adapter || f.N != folds[0].N || f.te != folds[0].te ||
        f.dtype != folds[0].dtype)
      return cudaErrorInvalidValue;
    if (cudaError_t err = cudaMemsetAsync(
            marks[s], 0, size_t(f.route.num_loras * f.route.n_experts + 1) * 4, stream);
        err != cudaSuccess)
      return err;
    const int64_t e_eff = std::min<int64_t>(f.route.n_experts, f.num_experts);
    sets.set[s] = PackSet{static_cast<const uint16_t*>(f.b_pool), f.route,
                          static_cast<uint16_t*>(b_ext[s]), marks[s], e_eff, int(f.R)};
    max_l = std::max(max_l, f.route.num_loras);
    max_e = std::max(max_e, e_eff);
  }
  const GroupedArgs& f = folds[0];
  if (max_e <= 0 || f.te <= 0) return cudaSuccess;
  constexpr int64_t kGridYZ = 65535;
  const dim3 grid(unsigned((f.N + kPackThreads - 1) / kPackThreads),
                  unsigned(std::min(max_l, kGridYZ)), unsigned(std::min(max_e, kGridYZ)));
  if (f.dtype == DType::kBf16)
    pack_b_ext<DType::kBf16><<<grid, kPackThreads, 0, stream>>>(sets, f.expert_offsets, f.N);
  else
    pack_b_ext<DType::kF16><<<grid, kPackThreads, 0, stream>>>(sets, f.expert_offsets, f.N);
  return cudaPeekAtLastError();
}

cudaError_t shrink_lora_ext(const GroupedArgs& f, cudaStream_t stream) {
  if (f.xa_ld != f.route.num_loras * f.R || !f.xa_by_adapter || f.row_offset > 0 ||
      f.row_end < f.te)
    return cudaErrorInvalidValue;
  if (f.te <= 0) return cudaSuccess;
  if (std::min<int64_t>(f.route.n_experts, f.num_experts) > 0)
    return fast::launch_grouped_shrink(f, stream);  // it zeroes xa (and xa2) as it goes
  for (void* xa : {f.xa, f.xa2}) {  // no expert to shrink for: xa_ext is all zeros
    if (xa == nullptr) continue;
    if (cudaError_t err = cudaMemsetAsync(xa, 0, size_t(f.te * f.xa_ld) * 2, stream);
        err != cudaSuccess)
      return err;
  }
  return cudaSuccess;
}

cudaError_t fold_marked_rows(const GroupedArgs* folds, int n_sets, cudaStream_t stream) {
  if (n_sets < 1 || n_sets > kExpertMatmulMaxWeights) return cudaErrorInvalidValue;
  MarkedSets sets = {};
  int64_t rows = 0;
  for (int s = 0; s < n_sets; ++s) {
    const GroupedArgs& f = folds[s];
    if (f.dtype != folds[0].dtype) return cudaErrorInvalidValue;
    sets.set[s] = f;
    rows = std::max<int64_t>(rows, std::min<int64_t>(f.row_end, f.te) -
                                       std::max<int64_t>(0, f.row_offset));
  }
  if (rows <= 0) return cudaSuccess;
  const dim3 grid(unsigned(std::min<int64_t>((rows + kMarkedWarps - 1) / kMarkedWarps,
                                             4 * int64_t(fast::sm_count()))),
                  unsigned(n_sets));
  if (folds[0].dtype == DType::kBf16)
    fold_marked_rows_kernel<DType::kBf16><<<grid, kMarkedThreads, 0, stream>>>(sets);
  else
    fold_marked_rows_kernel<DType::kF16><<<grid, kMarkedThreads, 0, stream>>>(sets);
  return cudaPeekAtLastError();
}

}  // namespace moelora
