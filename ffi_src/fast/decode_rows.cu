// Decode fold, one CTA per (row, column chunk) on the CUDA cores (bf16 / f16):
// the kernel for batches whose cells hold about one row each, where grouping
// rows buys nothing (launch_gather_fast's heuristic, decode_cells.cu).
//
// A decode row is a matrix-vector product bound by the latency of its loads,
// so the kernel is written to wait on as few dependent round trips as
// possible: the row's adapter and expert id (one trip), its pair (a second),
// then everything else at once:
//   - the thread's first 4 output columns (8 bytes of base_out) and their B
//     rows (the rank is a template argument, so every load is unrolled);
//   - shrink: thread t owns the 8-wide K pieces 8t, 8t + 2048, ...; all the
//     ranks of a pass (16) are loaded together with the x piece (16-byte
//     loads), summed in k order per thread, then a fixed butterfly per warp
//     and the 8 warp sums in warp order; xa is rounded into shared memory;
//   - expand: delta = round(xa . B[n]) in rank order, out = round(out +
//     scale * delta), one 8-byte store; further column rounds (N > 1024)
//     load their operands one trip at a time.

#include "fast/fast_common.cuh"

namespace moelora {
namespace fast {
namespace {

constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kRowCols = 4;   // adjacent output columns per thread and round
constexpr int kRowRounds = 2; // column rounds per CTA before the columns are split over CTAs
constexpr int kRowMaxRank = 64;

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

// The operands of one round of a thread's output columns [col, col + 4).
template <int RB>
struct ExpandOps {
  uint4 b[kRowCols][RB];  // B rows, 8 ranks per uint4
  uint16_t o[kRowCols];   // base_out

  __device__ __forceinline__ void load(const uint16_t* B, const uint16_t* orow, int64_t col,
                                       int64_t c1, bool nvec) {
#pragma unroll
    for (int c = 0; c < kRowCols; ++c) {
      o[c] = 0;
#pragma unroll
      for (int r = 0; r < RB; ++r)
        b[c][r] = col + c < c1 ? __ldg(reinterpret_cast<const uint4*>(B + (col + c) * (8 * RB)) + r)
                               : make_uint4(0u, 0u, 0u, 0u);
    }
    if (nvec && col + kRowCols <= c1) {
      const uint2 v = *reinterpret_cast<const uint2*>(orow + col);
      memcpy(o, &v, 8);
    } else {
#pragma unroll
      for (int c = 0; c < kRowCols; ++c)
        if (col + c < c1) o[c] = orow[col + c];
    }
  }
};

// One row of a CTA, its pair resolved by gather_rows_kernel below.
template <DType D, int RB>
__device__ __forceinline__ void fold_row(const GatherArgs& a, int64_t row, const Pair& pair,
                                         int64_t chunk_w, bool nvec,
                                         float (&s_part)[kRowWarps][8 * RB],
                                         float (&s_xa)[8 * RB]) {
  constexpr int R = 8 * RB;
  constexpr int RP = R % 16 == 0 ? 16 : 8;  // ranks per shrink pass
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int64_t K = a.K, N = a.N;
  uint16_t* orow = static_cast<uint16_t*>(a.out) + row * N;
  const uint16_t* B = static_cast<const uint16_t*>(a.b_pool) + int64_t(pair.b) * N * R;
  const int64_t c1 = min(N, int64_t(blockIdx.y + 1) * chunk_w);
  int64_t col = int64_t(blockIdx.y) * chunk_w + int64_t(tid) * kRowCols;
  ExpandOps<RB> ops;
  if (col < c1) ops.load(B, orow, col, c1, nvec);

  const uint16_t* x =
      static_cast<const uint16_t*>(a.x) + (a.x_gather ? row / a.top_k : row) * K;
  const uint16_t* A = static_cast<const uint16_t*>(a.a_pool) + int64_t(pair.a) * R * K;
#pragma unroll
  for (int p0 = 0; p0 < R; p0 += RP) {
    float acc[RP];
#pragma unroll
    for (int j = 0; j < RP; ++j) acc[j] = 0.f;
    for (int64_t k = int64_t(tid) * 8; k < K; k += kRowThreads * 8) {
      uint4 av[RP];
#pragma unroll
      for (int j = 0; j < RP; ++j)
        av[j] = __ldg(reinterpret_cast<const uint4*>(A + int64_t(p0 + j) * K + k));
      const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + k));
#pragma unroll
      for (int j = 0; j < RP; ++j) acc[j] = dot8<D>(av[j], xv, acc[j]);
    }
#pragma unroll
    for (int j = 0; j < RP; ++j) {
#pragma unroll
      for (int s = 16; s > 0; s >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], s);
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < RP; ++j) s_part[w][p0 + j] = acc[j];
    }
  }
  __syncthreads();
  if (tid < R) {
    float v = s_part[0][tid];
#pragma unroll
    for (int ww = 1; ww < kRowWarps; ++ww) v += s_part[ww][tid];
    s_xa[tid] = h2f<D>(f2h<D>(v));
  }
  __syncthreads();
  float xa[R];
#pragma unroll
  for (int j = 0; j < R; ++j) xa[j] = s_xa[j];

  while (col < c1) {
#pragma unroll
    for (int c = 0; c < kRowCols; ++c) {
      float acc = 0.f;
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        const uint32_t bw[4] = {ops.b[c][r].x, ops.b[c][r].y, ops.b[c][r].z, ops.b[c][r].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc = fmaf(xa[8 * r + 2 * i], h2f<D>(uint16_t(bw[i] & 0xffffu)), acc);
          acc = fmaf(xa[8 * r + 2 * i + 1], h2f<D>(uint16_t(bw[i] >> 16)), acc);
        }
      }
      const float delta = h2f<D>(f2h<D>(acc));
      ops.o[c] = f2h<D>(fold_add(h2f<D>(ops.o[c]), pair.scale, delta));
    }
    if (nvec && col + kRowCols <= c1) {
      uint2 v;
      memcpy(&v, ops.o, 8);
      *reinterpret_cast<uint2*>(orow + col) = v;
    } else {
#pragma unroll
      for (int c = 0; c < kRowCols; ++c)
        if (col + c < c1) orow[col + c] = ops.o[c];
    }
    col += int64_t(kRowThreads) * kRowCols;
    if (col < c1) ops.load(B, orow, col, c1, nvec);
  }
}

// CTA x owns rows [x * RPC, x * RPC + RPC): their routing is resolved first,
// one thread a row (two round trips for all of them), then the rows are
// folded one after the other. MINB: CTAs per SM the registers must allow.
template <DType D, int RB, int RPC, int MINB>
__global__ void __launch_bounds__(kRowThreads, MINB) gather_rows_kernel(const GatherArgs a,
                                                                        int64_t chunk_w, bool nvec) {
  __shared__ float s_part[kRowWarps][8 * RB];
  __shared__ float s_xa[8 * RB];
  __shared__ Pair s_pair[RPC];
  __shared__ int s_ok[RPC];
  const int64_t row0 = int64_t(blockIdx.x) * RPC;
  if (threadIdx.x < RPC) {
    const int64_t row = row0 + threadIdx.x;
    int l, e;
    Pair pair{0, 0, 0.f};
    const bool ok = row < a.n_slots && gather_row_cell(a, row, &l, &e) &&
                    resolve_pair(a.route, l, e, &pair);
    s_pair[threadIdx.x] = pair;
    s_ok[threadIdx.x] = ok;
  }
  __syncthreads();
#pragma unroll 1
  for (int j = 0; j < RPC; ++j)
    if (s_ok[j]) fold_row<D, RB>(a, row0 + j, s_pair[j], chunk_w, nvec, s_part, s_xa);
}

// CTAs per SM a rank's kernel is compiled for (its register budget, 128 a
// thread for two): two up to rank 32, one above (ranks 40-64 need more than
// 128 registers to keep their loads in flight without spilling). Measured on
// the H200 (docs/perf_log.md): three CTAs (80 registers) spill and are slower
// at rank 16; two instead of one take rank 32 from 87 to 54 µs at T = 64.
constexpr int rows_min_blocks(int RB) { return RB <= 4 ? 2 : 1; }

template <DType D, int RB>
cudaError_t rows_rb(const GatherArgs& a, dim3 grid, int rpc, int64_t chunk_w, bool nvec,
                    cudaStream_t stream) {
  constexpr int MB = rows_min_blocks(RB);
  switch (rpc) {
    case 1: gather_rows_kernel<D, RB, 1, MB><<<grid, kRowThreads, 0, stream>>>(a, chunk_w, nvec); break;
    case 2: gather_rows_kernel<D, RB, 2, MB><<<grid, kRowThreads, 0, stream>>>(a, chunk_w, nvec); break;
    default: gather_rows_kernel<D, RB, 4, MB><<<grid, kRowThreads, 0, stream>>>(a, chunk_w, nvec); break;
  }
  return cudaPeekAtLastError();
}

template <DType D>
cudaError_t rows_dtype(const GatherArgs& a, dim3 grid, int rpc, int64_t chunk_w, bool nvec,
                       cudaStream_t stream) {
  switch (a.R / 8) {
    case 1: return rows_rb<D, 1>(a, grid, rpc, chunk_w, nvec, stream);
    case 2: return rows_rb<D, 2>(a, grid, rpc, chunk_w, nvec, stream);
    case 3: return rows_rb<D, 3>(a, grid, rpc, chunk_w, nvec, stream);
    case 4: return rows_rb<D, 4>(a, grid, rpc, chunk_w, nvec, stream);
    case 5: return rows_rb<D, 5>(a, grid, rpc, chunk_w, nvec, stream);
    case 6: return rows_rb<D, 6>(a, grid, rpc, chunk_w, nvec, stream);
    case 7: return rows_rb<D, 7>(a, grid, rpc, chunk_w, nvec, stream);
    case 8: return rows_rb<D, 8>(a, grid, rpc, chunk_w, nvec, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool gather_rows_fits(const GatherArgs& a) {
  return a.R % 8 == 0 && a.R <= kRowMaxRank && a.K % 8 == 0 && aligned16(a.x) &&
         aligned16(a.a_pool) && aligned16(a.b_pool);
}

cudaError_t launch_gather_rows(const GatherArgs& a, cudaStream_t stream) {
  // Enough CTAs for every SM (few rows split their columns into chunks; each
  // chunk repeats the shrink, from L2) and at most kRowRounds column rounds.
  const int64_t quads = (a.N + kRowCols - 1) / kRowCols;
  const int64_t want = std::max<int64_t>(1, (sm_count() + a.n_slots - 1) / a.n_slots);
  const int64_t least = (quads + kRowThreads * kRowRounds - 1) / (kRowThreads * kRowRounds);
  const int64_t chunks0 = std::min<int64_t>({std::max(want, least), quads, 65535});
  const int64_t chunk_w = (quads + chunks0 - 1) / chunks0 * kRowCols;
  const int64_t chunks = (a.N + chunk_w - 1) / chunk_w;
  const bool nvec = a.N % kRowCols == 0 && aligned8(a.out);
  // Rows per CTA: the most of 4, 2, 1 that still leaves 70 % of a wave of
  // resident CTAs, so that a CTA resolves the routing of several rows at
  // once and runs them back to back without emptying SMs (H200, 4 adapters:
  // Qwen3 gate+up stacked T = 64, 1024 rows, 4 a CTA, 30.7 -> 26.6 µs; 512
  // rows, 2 a CTA: 14.4 -> 12.9 µs; DeepSeek gate T = 64, 384 rows, 2 a CTA:
  // 16.3 -> 13.9 µs; 256 rows keep 1).
  const int64_t resident = int64_t(sm_count()) * rows_min_blocks(int(a.R / 8));
  int rpc = 4;
  while (rpc > 1 && (chunks > 1 || 10 * a.n_slots < 7 * resident * rpc)) rpc /= 2;
  const dim3 grid(unsigned((a.n_slots + rpc - 1) / rpc), unsigned(chunks), 1);
  return a.dtype == DType::kBf16 ? rows_dtype<DType::kBf16>(a, grid, rpc, chunk_w, nvec, stream)
                                 : rows_dtype<DType::kF16>(a, grid, rpc, chunk_w, nvec, stream);
}

}  // namespace fast
}  // namespace moelora
