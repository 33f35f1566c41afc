// Decode fold, one CTA per (row, column chunk) on the CUDA cores (bf16 / f16):
// the kernel for batches whose cells hold about one row each, where grouping
// rows buys nothing (launch_gather_fast's heuristic, decode_cells.cu).
//
//   1. the row's adapter and expert id (one round trip), its pair from the
//      tables (a second one); the thread's output columns are requested now;
//   2. shrink: thread t owns the 8-wide K pieces 8t, 8t + 2048, ...; every
//      rank of a pass of kRowRanks is loaded at once (16-byte loads of A and
//      x), summed in k order per thread, then a fixed butterfly per warp and
//      the 8 warp sums in warp order; xa is rounded into shared memory;
//   3. expand: thread t folds the 8 adjacent columns c0 + 8t .. c0 + 8t + 7
//      (one 16-byte load and store of base_out): delta = round(xa . B[n]) in
//      rank order, out = round(out + scale * delta).

#include "fast/fast_common.cuh"

namespace moelora {
namespace fast {
namespace {

constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kRowRanks = 16;                       // ranks per shrink pass
constexpr int kRowCols = 8;                         // adjacent columns per thread
constexpr int64_t kRowChunk = kRowThreads * kRowCols;  // widest column chunk of a CTA

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
__global__ void __launch_bounds__(kRowThreads) gather_rows_kernel(const GatherArgs a,
                                                                  int64_t chunk_w, bool nvec) {
  __shared__ float s_part[kRowWarps][kRowRanks];
  __shared__ float s_xa[kMaxRank];
  const int64_t row = blockIdx.x;
  int l, e;
  if (!gather_row_cell(a, row, &l, &e)) return;  // uniform over the CTA
  Pair pair;
  if (!resolve_pair(a.route, l, e, &pair)) return;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int R = int(a.R);
  const int64_t K = a.K, N = a.N;
  uint16_t* orow = static_cast<uint16_t*>(a.out) + row * N;
  const int64_t c1 = min(N, int64_t(blockIdx.y + 1) * chunk_w);
  const int64_t col = int64_t(blockIdx.y) * chunk_w + int64_t(tid) * kRowCols;
  const bool full = nvec && col + kRowCols <= c1;
  uint16_t o[kRowCols] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (full) {
    const uint4 v = *reinterpret_cast<const uint4*>(orow + col);
    memcpy(o, &v, 16);
  } else {
#pragma unroll
    for (int c = 0; c < kRowCols; ++c)
      if (col + c < c1) o[c] = orow[col + c];
  }
  const uint16_t* x =
      static_cast<const uint16_t*>(a.x) + (a.x_gather ? row / a.top_k : row) * K;
  const uint16_t* A = static_cast<const uint16_t*>(a.a_pool) + int64_t(pair.a) * R * K;
  for (int p0 = 0; p0 < R; p0 += kRowRanks) {
    float acc[kRowRanks];
#pragma unroll
    for (int j = 0; j < kRowRanks; ++j) acc[j] = 0.f;
    for (int64_t k = int64_t(tid) * 8; k < K; k += kRowThreads * 8) {
      const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + k));
#pragma unroll
      for (int j = 0; j < kRowRanks; ++j)
        if (p0 + j < R)
          acc[j] = dot8<D>(__ldg(reinterpret_cast<const uint4*>(A + int64_t(p0 + j) * K + k)),
                           xv, acc[j]);
    }
#pragma unroll
    for (int j = 0; j < kRowRanks; ++j) {
#pragma unroll
      for (int s = 16; s > 0; s >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], s);
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < kRowRanks; ++j) s_part[w][j] = acc[j];
    }
    __syncthreads();
    if (tid < kRowRanks && p0 + tid < R) {
      float v = s_part[0][tid];
#pragma unroll
      for (int ww = 1; ww < kRowWarps; ++ww) v += s_part[ww][tid];
      s_xa[p0 + tid] = h2f<D>(f2h<D>(v));
    }
    __syncthreads();
  }
  if (col >= c1) return;
  const uint16_t* B = static_cast<const uint16_t*>(a.b_pool) + int64_t(pair.b) * N * R;
#pragma unroll
  for (int c = 0; c < kRowCols; ++c) {
    if (col + c >= c1) continue;
    const uint16_t* brow = B + (col + c) * R;
    float acc = 0.f;
    for (int j = 0; j < R; j += 8) {  // R % 8 == 0: 16-byte B rows
      const uint4 bv = __ldg(reinterpret_cast<const uint4*>(brow + j));
      const uint32_t b4[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc = fmaf(s_xa[j + 2 * i], h2f<D>(uint16_t(b4[i] & 0xffffu)), acc);
        acc = fmaf(s_xa[j + 2 * i + 1], h2f<D>(uint16_t(b4[i] >> 16)), acc);
      }
    }
    const float delta = h2f<D>(f2h<D>(acc));
    o[c] = f2h<D>(fold_add(h2f<D>(o[c]), pair.scale, delta));
  }
  if (full) {
    uint4 v;
    memcpy(&v, o, 16);
    *reinterpret_cast<uint4*>(orow + col) = v;
  } else {
#pragma unroll
    for (int c = 0; c < kRowCols; ++c)
      if (col + c < c1) orow[col + c] = o[c];
  }
}

}  // namespace

cudaError_t launch_gather_rows(const GatherArgs& a, cudaStream_t stream) {
  // Enough CTAs for every SM: few rows split their columns into chunks of
  // whole 8-column pieces (each chunk repeats the shrink, from L2).
  const int64_t want = std::max<int64_t>(1, (sm_count() + a.n_slots - 1) / a.n_slots);
  const int64_t min_chunks = (a.N + kRowChunk - 1) / kRowChunk;
  const int64_t chunks0 = std::min<int64_t>(
      {std::max(want, min_chunks), (a.N + kRowCols - 1) / kRowCols, 65535});
  int64_t chunk_w = (a.N + chunks0 - 1) / chunks0;
  chunk_w = (chunk_w + 63) / 64 * 64;
  const int64_t chunks = (a.N + chunk_w - 1) / chunk_w;
  const bool nvec = a.N % kRowCols == 0 && aligned16(a.out);
  if (a.dtype == DType::kBf16)
    gather_rows_kernel<DType::kBf16><<<dim3(unsigned(a.n_slots), unsigned(chunks), 1),
                                       kRowThreads, 0, stream>>>(a, chunk_w, nvec);
  else
    gather_rows_kernel<DType::kF16><<<dim3(unsigned(a.n_slots), unsigned(chunks), 1),
                                      kRowThreads, 0, stream>>>(a, chunk_w, nvec);
  return cudaPeekAtLastError();
}

}  // namespace fast
}  // namespace moelora
