// fp32 folds (gather and grouped): one CTA per (row, column chunk) on the
// CUDA cores, no TF32 (fp32 results are held to the fp32 tolerance).
//
// The router's LoRA is the typical fp32 fold: a short batch of rows, K =
// hidden, a few ranks, N = num_experts. The kernel waits on few dependent
// round trips: the row's routing (one or two), then everything else at once:
//   - thread t's first output column and its B row (the rank is a template
//     argument for ranks up to kF32MaxRank, so every load is unrolled);
//   - shrink: the 256 threads split K in 4-wide pieces (16-byte loads); each
//     thread keeps one partial sum per rank of the pass (16 ranks a pass
//     where R is a multiple of 16, else 8; the tiled kernel 8), in k order;
//     a fixed butterfly per warp (warp_sum_split: the ranks end on different
//     lanes), then the 8 warp sums in warp order give xa (shared memory). A
//     rank's sum does not depend on the pass it is in;
//   - expand: delta = xa . B[n] in rank order, out = out + scale * delta.
// The same device function serves both folds, so a row gets the same bits
// from either. Larger ranks and unaligned shapes take a loop over the ranks.
//
// The gather fold's x may be bf16 or f16 (the router's fold over the
// activations): each piece of 4 is one 8-byte load, widened exactly, so a row
// gets the bits of its x in fp32.
//
// Long gather batches (the router's fold at prefill, kF32TiledMinRows rows
// and more) take a tiled kernel: a CTA per kF32TileRows rows, whose rows of
// one pair fold kF32Group at a time with the same per-row order, so the bits
// do not depend on which kernel ran (or on the batch length).

#include "fast/fast_common.cuh"

namespace moelora {
namespace fast {
namespace {

constexpr int kF32Threads = 256;
constexpr int kF32Warps = kF32Threads / 32;
constexpr int kRankPass = 8;        // ranks per shrink pass (partial sums per thread)
constexpr int kF32MaxRank = 64;     // ranks with unrolled loads (RB = R / 8 template)
constexpr int64_t kF32Cols = 1024;  // output columns per CTA
constexpr int kF32Group = 4;        // rows of one pair folded together (tiled kernel)
constexpr int kF32TileRows = 16;    // rows per CTA of the tiled kernel
// Batches of at least this many rows take the tiled kernel (with 16-byte
// loads); below, one CTA a row is faster (H200, Qwen3 router, 4 adapters:
// 1024 rows 20.6 against 28.4 µs; 2048 rows 37.2 against 29.5 µs; 4096 rows
// 71.8 against 39.7 µs).
constexpr int64_t kF32TiledMinRows = 2048;

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// x[k .. k + 3] in fp32: one 16-byte load of fp32, one 8-byte load of bf16
// or f16 widened (exactly).
__device__ __forceinline__ float4 load_x4(const float* x, int64_t k) {
  return __ldg(reinterpret_cast<const float4*>(x + k));
}
__device__ __forceinline__ float4 load_x4(const __nv_bfloat16* x, int64_t k) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(x + k));  // element 0 in the low half
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                     __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ float4 load_x4(const __half* x, int64_t k) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(x + k));
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ float load_x1(const float* x, int64_t k) { return __ldg(x + k); }
__device__ __forceinline__ float load_x1(const __nv_bfloat16* x, int64_t k) {
  return __bfloat162float(__ldg(x + k));
}
__device__ __forceinline__ float load_x1(const __half* x, int64_t k) {
  return __half2float(__ldg(x + k));
}

// Column n's B row (R = 8 * RB floats) as 2 * RB 16-byte loads.
template <int RB>
__device__ __forceinline__ void load_b_row(float4* bv, const float* __restrict__ B, int64_t n) {
#pragma unroll
  for (int i = 0; i < 2 * RB; ++i) bv[i] = __ldg(reinterpret_cast<const float4*>(B + n * 8 * RB) + i);
}

// A's ranks p0 .. p0 + P - 1 at k .. k + 3 (16-byte loads).
template <int P>
__device__ __forceinline__ void load_a_pass(float4 (&av)[P], const float* __restrict__ A, int p0,
                                            int64_t K, int64_t k) {
#pragma unroll
  for (int j = 0; j < P; ++j)
    av[j] = __ldg(reinterpret_cast<const float4*>(A + int64_t(p0 + j) * K + k));
}

// Fold one row: x [K] (TX: float, or a gather fold's bf16 / f16), A [R, K],
// B [N, R] of its pair, output row orow, columns [c0, c1). RB > 0: R == 8 *
// RB and vector loads (K % 4 == 0, aligned arrays); RB == 0: any R, element
// loads. kept: where the row's xa is kept (a gather call's keep_xa, by the
// CTA of its first column chunk), or null.
template <int RB, class TX = float>
__device__ void f32_fold_row(const TX* __restrict__ x, const float* __restrict__ A,
                             const float* __restrict__ B, float scale, int64_t K, int R_, int64_t N,
                             float* orow, int64_t c0, int64_t c1, float* kept = nullptr) {
  constexpr bool kVec = RB > 0;
  // ranks a pass: 16 where R is a multiple of 16 (every A load of the row in
  // flight at once; a rank's sum does not depend on the pass it is in)
  constexpr int RP = kVec && RB % 2 == 0 ? 2 * kRankPass : kRankPass;
  const int R = kVec ? 8 * RB : R_;
  __shared__ float s_part[kF32Warps][RP];
  __shared__ float s_xa[kMaxRank];
  const int tid = threadIdx.x, w = tid >> 5;
  // the first column's operands, requested before the shrink
  int64_t n = c0 + tid;
  float4 bv[kVec ? 2 * RB : 1];
  float ov = 0.f;
  if (kVec && n < c1) {
    load_b_row<RB>(bv, B, n);
    ov = orow[n];
  }
  for (int p0 = 0; p0 < R; p0 += RP) {
    float acc[RP];
#pragma unroll
    for (int j = 0; j < RP; ++j) acc[j] = 0.f;
    if (kVec) {
#pragma unroll 2
      for (int64_t k = int64_t(tid) * 4; k < K; k += kF32Threads * 4) {
        float4 av[RP];
        load_a_pass<RP>(av, A, p0, K, k);
        const float4 xv = load_x4(x, k);
#pragma unroll
        for (int j = 0; j < RP; ++j) acc[j] = dot4(av[j], xv, acc[j]);
      }
    } else {
      for (int64_t k = tid; k < K; k += kF32Threads) {
        const float xv = load_x1(x, k);
#pragma unroll
        for (int j = 0; j < RP; ++j)
          if (p0 + j < R) acc[j] = fmaf(__ldg(A + int64_t(p0 + j) * K + k), xv, acc[j]);
      }
    }
    store_warp_sums<RP>(acc, s_part[w]);
    __syncthreads();
    if (tid < RP && p0 + tid < R) {
      float v = s_part[0][tid];
#pragma unroll
      for (int ww = 1; ww < kF32Warps; ++ww) v += s_part[ww][tid];
      s_xa[p0 + tid] = v;
      if (kept) kept[p0 + tid] = v;
    }
    __syncthreads();
  }
  for (; n < c1; n += kF32Threads) {
    float acc = 0.f;
    if (kVec) {
#pragma unroll
      for (int i = 0; i < 2 * RB; ++i)
        acc = dot4(bv[i], make_float4(s_xa[4 * i], s_xa[4 * i + 1], s_xa[4 * i + 2],
                                      s_xa[4 * i + 3]), acc);
      orow[n] = fold_add(ov, scale, acc);
      if (n + kF32Threads < c1) {
        const int64_t m = n + kF32Threads;
        load_b_row<RB>(bv, B, m);
        ov = orow[m];
      }
    } else {
      for (int j = 0; j < R; ++j) acc = fmaf(__ldg(B + n * R + j), s_xa[j], acc);
      orow[n] = fold_add(orow[n], scale, acc);
    }
  }
}

// The tiled kernel's fold of n <= G rows that share one pair (16-byte loads,
// R == 8 * RB): f32_fold_row's arithmetic for each row, in the same order, so
// a row gets the same bits from either kernel; each A and B load serves the n
// rows. Every thread of the CTA calls it with the same n. (f32_fold_row is not
// its G = 1 case: compiled that way the one-CTA kernel got 62 registers
// instead of 96 and ran up to 1.9 µs slower at decode sizes.) kept: each
// row's kept xa, as for f32_fold_row.
template <int RB, int G, class TX>
__device__ void f32_fold_rows(const TX* const* x, const float* __restrict__ A,
                              const float* __restrict__ B, float scale, int64_t K,
                              float* const* orow, float* const* kept, int nrows, int64_t c0,
                              int64_t c1) {
  static_assert(RB > 0, "16-byte loads only");
  constexpr int R = 8 * RB;
  __shared__ float s_part[kF32Warps][G][kRankPass];
  __shared__ float s_xa[G][R];
  const int tid = threadIdx.x, w = tid >> 5;
  int64_t n = c0 + tid;  // the first column's operands, requested before the shrink
  float4 bv[2 * RB];
  float ov[G];
  if (n < c1) {
    load_b_row<RB>(bv, B, n);
#pragma unroll
    for (int g = 0; g < G; ++g)
      if (g < nrows) ov[g] = orow[g][n];
  }
  for (int p0 = 0; p0 < R; p0 += kRankPass) {
    float acc[G][kRankPass] = {};
#pragma unroll 2
    for (int64_t k = int64_t(tid) * 4; k < K; k += kF32Threads * 4) {
      float4 av[kRankPass];
      load_a_pass<kRankPass>(av, A, p0, K, k);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (g < nrows) {
          const float4 xv = load_x4(x[g], k);
#pragma unroll
          for (int j = 0; j < kRankPass; ++j) acc[g][j] = dot4(av[j], xv, acc[g][j]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) store_warp_sums<kRankPass>(acc[g], s_part[w][g]);
    __syncthreads();
    if (tid < G * kRankPass) {
      const int g = tid / kRankPass, j = tid % kRankPass;
      float v = s_part[0][g][j];
#pragma unroll
      for (int ww = 1; ww < kF32Warps; ++ww) v += s_part[ww][g][j];
      s_xa[g][p0 + j] = v;
      if (g < nrows && kept[g]) kept[g][p0 + j] = v;
    }
    __syncthreads();
  }
  for (; n < c1; n += kF32Threads) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g < nrows) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < 2 * RB; ++i)
          acc = dot4(bv[i], make_float4(s_xa[g][4 * i], s_xa[g][4 * i + 1], s_xa[g][4 * i + 2],
                                        s_xa[g][4 * i + 3]), acc);
        orow[g][n] = fold_add(ov[g], scale, acc);
      }
    }
    if (n + kF32Threads < c1) {
      const int64_t m = n + kF32Threads;
      load_b_row<RB>(bv, B, m);
#pragma unroll
      for (int g = 0; g < G; ++g)
        if (g < nrows) ov[g] = orow[g][m];
    }
  }
}

template <int RB, class TX>
__global__ void __launch_bounds__(kF32Threads) gather_f32_kernel(const GatherArgs a) {
  const int64_t row = blockIdx.x;
  int l, e;
  if (!gather_row_cell(a, row, &l, &e)) return;
  Pair pair;
  if (!resolve_pair(a.route, l, e, &pair)) return;
  const int64_t c0 = int64_t(blockIdx.y) * kF32Cols, c1 = min(a.N, c0 + kF32Cols);
  f32_fold_row<RB>(a.x_row<TX>(row, e),
                   static_cast<const float*>(a.a_pool) + int64_t(pair.a) * a.R * a.K,
                   static_cast<const float*>(a.b_pool) + int64_t(pair.b) * a.N * a.R,
                   pair.scale, a.K, int(a.R), a.N, a.out_row<float>(row, e), c0, c1,
                   blockIdx.y == 0 ? a.kept_row<float>(row) : nullptr);
}

// Long batches (the router's fold at prefill): one CTA per TR consecutive
// rows (and column chunk). The rows' pairs are resolved together; rows with
// the same pair fold kF32Group at a time, so each A and B load serves up to
// kF32Group rows instead of one (the A block of a rank-16 router is 128 KB, so
// one CTA a row streams T * 128 KB through L2). Bit for bit as gather_f32_kernel.
template <int RB, int TR, class TX>
__global__ void __launch_bounds__(kF32Threads) gather_f32_tiled_kernel(const GatherArgs a) {
  static_assert(TR <= 32 && TR <= kF32Threads, "a tile's rows fit one 32-bit mask");
  __shared__ Pair s_pair[TR];
  __shared__ int s_ok[TR];
  __shared__ float* s_orow[TR];
  __shared__ const TX* s_x[TR];
  __shared__ float* s_kept[TR];
  const int tid = threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.x) * TR;
  if (tid < TR) {
    const int64_t row = r0 + tid;
    int l, e;
    Pair pair{};
    const bool ok = row < a.n_slots && gather_row_cell(a, row, &l, &e) &&
                    resolve_pair(a.route, l, e, &pair);
    s_ok[tid] = ok;
    s_pair[tid] = pair;
    s_orow[tid] = ok ? a.out_row<float>(row, e) : nullptr;
    s_x[tid] = ok ? a.x_row<TX>(row, e) : nullptr;
    s_kept[tid] = ok && blockIdx.y == 0 ? a.kept_row<float>(row) : nullptr;
  }
  __syncthreads();
  const int64_t c0 = int64_t(blockIdx.y) * kF32Cols, c1 = min(a.N, c0 + kF32Cols);
  // every thread walks the same groups (the CTA stays uniform)
  uint32_t todo = 0;
  for (int i = 0; i < TR; ++i) todo |= uint32_t(s_ok[i] != 0) << i;
  while (todo) {
    const int i = __ffs(todo) - 1;
    const Pair p = s_pair[i];
    const TX* xs[kF32Group];
    float *os[kF32Group], *ks[kF32Group];
    int n = 0;
    for (uint32_t m = todo; m && n < kF32Group; m &= m - 1) {
      const int j = __ffs(m) - 1;
      const Pair q = s_pair[j];
      if (q.a != p.a || q.b != p.b || __float_as_uint(q.scale) != __float_as_uint(p.scale))
        continue;
#pragma unroll
      for (int g = 0; g < kF32Group; ++g) {  // xs[n], os[n] with n in registers
        if (g == n) {
          xs[g] = s_x[j];
          os[g] = s_orow[j];
          ks[g] = s_kept[j];
        }
      }
      ++n;
      todo &= ~(1u << j);
    }
    f32_fold_rows<RB, kF32Group>(xs, static_cast<const float*>(a.a_pool) + int64_t(p.a) * a.R * a.K,
                                 static_cast<const float*>(a.b_pool) + int64_t(p.b) * a.N * a.R,
                                 p.scale, a.K, os, ks, n, c0, c1);
  }
}

template <int RB>
__global__ void __launch_bounds__(kF32Threads) grouped_f32_kernel(const GroupedArgs a,
                                                                  int64_t lo) {
  if (!cta_offsets_well_formed(a.expert_offsets, a.num_experts, a.te)) return;  // uniform
  const int64_t r = lo + blockIdx.x;
  int64_t orow;
  if (!grouped_out_row(a.out_rows, a.m, r, &orow)) return;
  const int64_t e = find_expert(a.expert_offsets, a.num_experts, r);
  if (e < 0) return;
  int64_t tok, ad;
  if (!grouped_row_adapter(a.sorted_token_ids, a.row_adapter, a.has_row_adapter, a.num_tokens,
                           a.x_gather, r, &tok, &ad))
    return;
  Pair pair;
  if (!resolve_pair(a.route, ad, e, &pair)) return;
  const int64_t c0 = int64_t(blockIdx.y) * kF32Cols, c1 = min(a.N, c0 + kF32Cols);
  const int64_t xrow = a.x_gather ? tok : r;
  f32_fold_row<RB>(static_cast<const float*>(a.x) + xrow * a.K,
                   static_cast<const float*>(a.a_pool) + int64_t(pair.a) * a.R * a.K,
                   static_cast<const float*>(a.b_pool) + int64_t(pair.b) * a.N * a.R,
                   pair.scale, a.K, int(a.R), a.N, static_cast<float*>(a.out) + orow * a.N, c0,
                   c1);
}

// The rank template argument for these arrays: R / 8 when vector loads of
// 4 values of x (x_bytes each) and 16-byte loads of A and B rows are possible
// and R <= kF32MaxRank, else 0 (element loads).
int f32_rank_blocks(const void* x, int x_bytes, const void* a_pool, const void* b_pool, int64_t K,
                    int64_t R) {
  const bool x_ok = (reinterpret_cast<uintptr_t>(x) & uintptr_t(4 * x_bytes - 1)) == 0;
  const bool vec = K % 4 == 0 && x_ok && aligned16(a_pool) && aligned16(b_pool);
  return vec && R % 8 == 0 && R <= kF32MaxRank ? int(R / 8) : 0;
}

template <class Launch>
cudaError_t by_rank(int rb, Launch launch) {
  switch (rb) {
    case 1: return launch(std::integral_constant<int, 1>());
    case 2: return launch(std::integral_constant<int, 2>());
    case 3: return launch(std::integral_constant<int, 3>());
    case 4: return launch(std::integral_constant<int, 4>());
    case 5: return launch(std::integral_constant<int, 5>());
    case 6: return launch(std::integral_constant<int, 6>());
    case 7: return launch(std::integral_constant<int, 7>());
    case 8: return launch(std::integral_constant<int, 8>());
    default: return launch(std::integral_constant<int, 0>());
  }
}

template <class TX>
cudaError_t launch_gather_f32_x(const GatherArgs& a, cudaStream_t stream) {
  const unsigned col_chunks = unsigned((a.N + kF32Cols - 1) / kF32Cols);
  const int rb = f32_rank_blocks(a.x, int(sizeof(TX)), a.a_pool, a.b_pool, a.K, a.R);
  if (rb > 0 && a.n_slots >= kF32TiledMinRows) {
    const dim3 grid(unsigned((a.n_slots + kF32TileRows - 1) / kF32TileRows), col_chunks, 1);
    return by_rank(rb, [&](auto r) {
      if constexpr (decltype(r)::value > 0)
        gather_f32_tiled_kernel<decltype(r)::value, kF32TileRows, TX>
            <<<grid, kF32Threads, 0, stream>>>(a);
      return cudaPeekAtLastError();
    });
  }
  const dim3 grid(unsigned(a.n_slots), col_chunks, 1);
  return by_rank(rb, [&](auto r) {
    gather_f32_kernel<decltype(r)::value, TX><<<grid, kF32Threads, 0, stream>>>(a);
    return cudaPeekAtLastError();
  });
}

}  // namespace

cudaError_t launch_gather_f32(const GatherArgs& a, cudaStream_t stream) {
  switch (a.x_dtype) {
    case DType::kBf16: return launch_gather_f32_x<__nv_bfloat16>(a, stream);
    case DType::kF16: return launch_gather_f32_x<__half>(a, stream);
    case DType::kF32: return launch_gather_f32_x<float>(a, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_grouped_f32(const GroupedArgs& a, cudaStream_t stream) {
  const int64_t lo = std::max<int64_t>(0, a.row_offset);
  const int64_t hi = std::min<int64_t>(a.row_end, a.te);
  if (hi <= lo) return cudaSuccess;
  const dim3 grid(unsigned(hi - lo), unsigned((a.N + kF32Cols - 1) / kF32Cols), 1);
  return by_rank(f32_rank_blocks(a.x, 4, a.a_pool, a.b_pool, a.K, a.R), [&](auto rb) {
    grouped_f32_kernel<decltype(rb)::value><<<grid, kF32Threads, 0, stream>>>(a, lo);
    return cudaPeekAtLastError();
  });
}

}  // namespace fast
}  // namespace moelora
