// Decode fold, one CTA per (row, column chunk) on the CUDA cores (bf16 / f16):
// the kernel for batches whose cells hold about one row each, where grouping
// rows buys nothing (launch_gather_fast's heuristic, decode_cells.cu).
//
// A decode row is a matrix-vector product bound by loads:
//   1. warp w computes xa[j] for j = w, w + 8, ...: lanes stride K with
//      16-byte loads of A and x (fp32 partial sums in k order per lane, then a
//      fixed butterfly), rounded to the dtype into shared memory;
//   2. thread t folds columns c0 + t, c0 + t + kRowThreads, ... of the chunk:
//      delta = round(xa . B[n]) (16-byte loads of the B row, rank order),
//      out = round(out + scale * delta).
// One barrier; A and B blocks shared by several rows are re-read from L2.

#include "fast/fast_common.cuh"

namespace moelora {
namespace fast {
namespace {

constexpr int kRowThreads = 256;

template <DType D>
__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
  const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = fmaf(h2f<D>(uint16_t(av[i] & 0xffffu)), h2f<D>(uint16_t(bv[i] & 0xffffu)), acc);
    acc = fmaf(h2f<D>(uint16_t(av[i] >> 16)), h2f<D>(uint16_t(bv[i] >> 16)), acc);
  }
  return acc;
}

template <DType D>
__device__ __forceinline__ float dot8_f(uint4 b, const float* xa, float acc) {
  const uint32_t bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = fmaf(xa[2 * i], h2f<D>(uint16_t(bv[i] & 0xffffu)), acc);
    acc = fmaf(xa[2 * i + 1], h2f<D>(uint16_t(bv[i] >> 16)), acc);
  }
  return acc;
}

template <DType D>
__global__ void __launch_bounds__(kRowThreads)
    gather_rows_kernel(const GatherArgs a, int64_t chunk_w) {
  __shared__ float s_xa[kMaxRank];
  const int64_t row = blockIdx.x;
  int l, e;
  if (!gather_row_cell(a, row, &l, &e)) return;  // uniform over the CTA
  Pair pair;
  if (!resolve_pair(a.route, l, e, &pair)) return;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int R = int(a.R);
  const uint16_t* x =
      static_cast<const uint16_t*>(a.x) + (a.x_gather ? row / a.top_k : row) * a.K;
  const uint16_t* A = static_cast<const uint16_t*>(a.a_pool) + int64_t(pair.a) * R * a.K;
  for (int j = w; j < R; j += kRowThreads / 32) {
    const uint16_t* arow = A + int64_t(j) * a.K;
    float acc = 0.f;
#pragma unroll 4
    for (int64_t k = int64_t(lane) * 8; k < a.K; k += 32 * 8)
      acc = dot8<D>(__ldg(reinterpret_cast<const uint4*>(arow + k)),
                    __ldg(reinterpret_cast<const uint4*>(x + k)), acc);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) s_xa[j] = h2f<D>(f2h<D>(acc));
  }
  __syncthreads();
  const uint16_t* B = static_cast<const uint16_t*>(a.b_pool) + int64_t(pair.b) * a.N * R;
  uint16_t* orow = static_cast<uint16_t*>(a.out) + row * a.N;
  const int64_t c0 = int64_t(blockIdx.y) * chunk_w, c1 = min(a.N, c0 + chunk_w);
  for (int64_t n = c0 + threadIdx.x; n < c1; n += kRowThreads) {
    const uint16_t* brow = B + n * R;
    float acc = 0.f;
    for (int j = 0; j < R; j += 8)  // R % 8 == 0: 16-byte B rows
      acc = dot8_f<D>(__ldg(reinterpret_cast<const uint4*>(brow + j)), s_xa + j, acc);
    const float delta = h2f<D>(f2h<D>(acc));
    orow[n] = f2h<D>(fold_add(h2f<D>(orow[n]), pair.scale, delta));
  }
}

}  // namespace

cudaError_t launch_gather_rows(const GatherArgs& a, cudaStream_t stream) {
  // Enough CTAs for every SM: split the columns of few rows into chunks of
  // whole kRowThreads multiples (each chunk recomputes xa from L2).
  const int64_t max_chunks = std::max<int64_t>(1, (a.N + kRowThreads - 1) / kRowThreads);
  const int64_t want = std::max<int64_t>(1, (sm_count() + a.n_slots - 1) / a.n_slots);
  const int64_t chunks0 = std::min<int64_t>(std::min<int64_t>(want, max_chunks), 65535);
  int64_t chunk_w = (a.N + chunks0 - 1) / chunks0;
  chunk_w = (chunk_w + kRowThreads - 1) / kRowThreads * kRowThreads;
  const int64_t chunks = (a.N + chunk_w - 1) / chunk_w;
  const dim3 grid(unsigned(a.n_slots), unsigned(chunks), 1);
  if (a.dtype == DType::kBf16)
    gather_rows_kernel<DType::kBf16><<<grid, kRowThreads, 0, stream>>>(a, chunk_w);
  else
    gather_rows_kernel<DType::kF16><<<grid, kRowThreads, 0, stream>>>(a, chunk_w);
  return cudaPeekAtLastError();
}

}  // namespace fast
}  // namespace moelora
