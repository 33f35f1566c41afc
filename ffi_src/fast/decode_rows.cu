// Decode fold on the CUDA cores (bf16 / f16) for batches whose cells hold
// about one row each, where grouping rows buys nothing (launch_gather_fast's
// heuristic, decode_cells.cu). Two kernels, the same arithmetic per row:
//
// gather_rows_staged_kernel, when every SM gets at least two rows and two
// rows' A, x and B fit in shared memory (Qwen3 and DeepSeek at T = 64, rank
// <= 32): a CTA per SM owns a run of consecutive rows, resolves their routing
// at once, then streams each folding row's A block, x row and B block into
// shared memory with bulk asynchronous copies (TMA), two rows ahead, while it
// folds the current one; base_out columns are loaded a row ahead into
// registers. The bytes in flight need no registers, so an SM keeps two rows'
// loads going at one CTA.
//
// gather_rows_kernel, otherwise (T <= 16, larger ranks or widths): one CTA
// per 1, 2 or 4 rows, or per (row, column chunk). A decode row is a
// matrix-vector product bound by the latency of its loads, so the kernel
// waits on as few dependent round trips as possible: the row's adapter and
// expert id (one trip), its pair (a second), then everything else at once:
// the thread's first 4 output columns (8 bytes of base_out) and their B rows
// (the rank is a template argument, so every load is unrolled), A and x.
//
// Per row, in both:
//   - shrink: thread t owns the 8-wide K pieces 8t, 8t + 2048, ...; all the
//     ranks of a pass (16) are loaded together with the x piece (16-byte
//     loads), summed in k order per thread, then a fixed butterfly per warp
//     (warp_sum_split: the ranks end on different lanes) and the 8 warp sums
//     in warp order; xa is rounded into shared memory (with keep_xa also
//     into the kept rows);
//   - expand: delta = round(xa . B[n]) in rank order, out = round(out +
//     scale * delta).

#include "fast/fast_common.cuh"

namespace moelora {
namespace fast {
namespace {

constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kRowCols = 4;   // adjacent output columns per thread and round
constexpr int kRowRounds = 2; // column rounds per CTA before the columns are split over CTAs
constexpr int kRowMaxRank = 64;

// The 8 values of a 16-byte piece as floats, in element order (bf16: the
// bits moved into place, which is the exact conversion; f16: converted).
template <DType D>
__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (D == DType::kBf16) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      f[2 * i] = h2f<D>(uint16_t(w[i] & 0xffffu));
      f[2 * i + 1] = h2f<D>(uint16_t(w[i] >> 16));
    }
  }
}

// 16 bytes of a row's operands, from global memory (read-only path) or
// from shared memory.
template <bool kSmem>
__device__ __forceinline__ uint4 ld16(const uint16_t* p) {
  if constexpr (kSmem) return *reinterpret_cast<const uint4*>(p);
  else return __ldg(reinterpret_cast<const uint4*>(p));
}

// The shrink of one row, xa = round(A x) into s_xa (A [R, K], x [K], in
// global or shared memory): thread t owns the 8-wide K pieces 8t, 8t + 2048,
// ...; the ranks of a pass are loaded together with the x piece and summed
// in k order per thread, then a fixed butterfly per warp (warp_sum_split)
// and the warp sums in warp order. Both rows kernels fold through it, so a
// row gets the same bits from either. `kept`: the row's kept xa (keep_xa,
// written once: by the CTA of its first column chunk), or null. Called by
// all threads; ends with a barrier.
template <DType D, int RB, bool kSmem>
__device__ __forceinline__ void shrink_row(const uint16_t* A, const uint16_t* x, int64_t K,
                                           float (&s_part)[kRowWarps][8 * RB],
                                           float (&s_xa)[8 * RB], uint16_t* kept) {
  constexpr int R = 8 * RB;
  constexpr int RP = R % 16 == 0 ? 16 : 8;  // ranks per shrink pass
  const int tid = threadIdx.x, w = tid >> 5;
#pragma unroll
  for (int p0 = 0; p0 < R; p0 += RP) {
    float acc[RP];
#pragma unroll
    for (int j = 0; j < RP; ++j) acc[j] = 0.f;
    for (int64_t k = int64_t(tid) * 8; k < K; k += kRowThreads * 8) {
      uint4 av[RP];
#pragma unroll
      for (int j = 0; j < RP; ++j) av[j] = ld16<kSmem>(A + int64_t(p0 + j) * K + k);
      float xf[8];
      unpack8<D>(ld16<kSmem>(x + k), xf);
#pragma unroll
      for (int j = 0; j < RP; ++j) {
        float af[8];
        unpack8<D>(av[j], af);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[j] = fmaf(af[e], xf[e], acc[j]);
      }
    }
    store_warp_sums<RP>(acc, &s_part[w][p0]);
  }
  __syncthreads();
  if (tid < R) {
    float v = s_part[0][tid];
#pragma unroll
    for (int ww = 1; ww < kRowWarps; ++ww) v += s_part[ww][tid];
    s_xa[tid] = h2f<D>(f2h<D>(v));
    if (kept) kept[tid] = f2h<D>(v);
  }
  __syncthreads();
}

// One output column's delta, round(xa . B[n]) in rank order (b: B[n]).
template <DType D, int RB>
__device__ __forceinline__ float expand_col(const uint4 (&b)[RB], const float (&xa)[8 * RB]) {
  float acc = 0.f;
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    float bf[8];
    unpack8<D>(b[r], bf);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(xa[8 * r + e], bf[e], acc);
  }
  return h2f<D>(f2h<D>(acc));
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

// One row of a CTA (x: its x row), its pair resolved by gather_rows_kernel below.
template <DType D, int RB>
__device__ __forceinline__ void fold_row(const GatherArgs& a, const uint16_t* x, const Pair& pair,
                                         uint16_t* orow, uint16_t* kept, int64_t chunk_w,
                                         bool nvec, float (&s_part)[kRowWarps][8 * RB],
                                         float (&s_xa)[8 * RB]) {
  constexpr int R = 8 * RB;
  const int tid = threadIdx.x;
  const int64_t K = a.K, N = a.N;
  const uint16_t* B = static_cast<const uint16_t*>(a.b_pool) + int64_t(pair.b) * N * R;
  const int64_t c1 = min(N, int64_t(blockIdx.y + 1) * chunk_w);
  int64_t col = int64_t(blockIdx.y) * chunk_w + int64_t(tid) * kRowCols;
  ExpandOps<RB> ops;
  if (col < c1) ops.load(B, orow, col, c1, nvec);

  const uint16_t* A = static_cast<const uint16_t*>(a.a_pool) + int64_t(pair.a) * R * K;
  shrink_row<D, RB, false>(A, x, K, s_part, s_xa, blockIdx.y == 0 ? kept : nullptr);
  float xa[R];
#pragma unroll
  for (int j = 0; j < R; ++j) xa[j] = s_xa[j];

  while (col < c1) {
#pragma unroll
    for (int c = 0; c < kRowCols; ++c)
      ops.o[c] = f2h<D>(fold_add(h2f<D>(ops.o[c]), pair.scale, expand_col<D, RB>(ops.b[c], xa)));
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
  __shared__ uint16_t* s_orow[RPC];
  __shared__ const uint16_t* s_x[RPC];
  __shared__ uint16_t* s_kept[RPC];
  const int64_t row0 = int64_t(blockIdx.x) * RPC;
  if (threadIdx.x < RPC) {
    const int64_t row = row0 + threadIdx.x;
    int l, e;
    Pair pair{0, 0, 0.f};
    const bool ok = row < a.n_slots && gather_row_cell(a, row, &l, &e) &&
                    resolve_pair(a.route, l, e, &pair);
    s_pair[threadIdx.x] = pair;
    s_ok[threadIdx.x] = ok;
    s_orow[threadIdx.x] = ok ? a.out_row<uint16_t>(row, e) : nullptr;
    s_x[threadIdx.x] = ok ? a.x_row<uint16_t>(row, e) : nullptr;
    s_kept[threadIdx.x] = ok ? a.kept_row<uint16_t>(row) : nullptr;
  }
  __syncthreads();
#pragma unroll 1
  for (int j = 0; j < RPC; ++j)
    if (s_ok[j])
      fold_row<D, RB>(a, s_x[j], s_pair[j], s_orow[j], s_kept[j], chunk_w, nvec, s_part, s_xa);
}

// The staged rows kernel: a CTA per SM owns a run of consecutive rows and
// streams each folding row's A block, x row and B block into shared memory
// with bulk asynchronous copies, kStagedStages rows ahead, so the copies of
// the next rows are in flight (without registers) while the CTA folds one;
// each thread's base_out columns are loaded one row ahead into registers.
// Thread t owns output columns t, t + 256, ... (reading B from shared memory
// with 2-way bank conflicts); the arithmetic is shrink_row's and
// expand_col's, so a row gets the same bits as from gather_rows_kernel.
constexpr int kStagedStages = 2;
constexpr int kStagedMaxRows = 64;                        // rows a CTA resolves at once
constexpr int kStagedMaxCols = 8;                         // columns a thread (N <= 2048)
constexpr int kStagedMaxSmem = 224 * 1024;  // dynamic bytes: 227 KiB a CTA, 3 KiB static aside

struct StagedLayout {  // one stage: A [R, K], x [K], B [N, R] (16-bit, 16-byte multiples)
  int64_t a_bytes, x_bytes, b_bytes, stage;
  __host__ __device__ StagedLayout(int64_t R, int64_t K, int64_t N)
      : a_bytes(2 * R * K), x_bytes(2 * K), b_bytes(2 * N * R),
        stage(a_bytes + x_bytes + b_bytes) {}
  int64_t smem() const { return kStagedStages * stage; }  // dynamic bytes of a launch
};

template <DType D, int RB>
__global__ void __launch_bounds__(kRowThreads, 1)
    gather_rows_staged_kernel(const GatherArgs a, int rows_per_cta) {
  constexpr int R = 8 * RB;
  extern __shared__ __align__(128) char smem[];
  __shared__ float s_part[kRowWarps][R];
  __shared__ float s_xa[R];
  __shared__ Pair s_pair[kStagedMaxRows];
  __shared__ const uint16_t* s_x[kStagedMaxRows];
  __shared__ uint16_t* s_orow[kStagedMaxRows];
  __shared__ uint16_t* s_kept[kStagedMaxRows];
  __shared__ int s_count[2];
  __shared__ __align__(8) uint64_t s_full[kStagedStages];
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int64_t K = a.K, N = a.N;
  const StagedLayout lay(R, K, N);

  // 1. the routing of the CTA's rows (two round trips); the folding ones
  // listed in row order (a ballot per warp)
  const int64_t row0 = int64_t(blockIdx.x) * rows_per_cta;
  bool ok = false;
  Pair pair{0, 0, 0.f};
  int l, e = 0;
  if (tid < kStagedMaxRows) {
    const int64_t row = row0 + tid;
    ok = tid < rows_per_cta && row < a.n_slots && gather_row_cell(a, row, &l, &e) &&
         resolve_pair(a.route, l, e, &pair);
  }
  const unsigned mask = __ballot_sync(0xffffffffu, ok);
  if (tid < kStagedMaxRows && lane == 0) s_count[w] = __popc(mask);
  if (tid == 0) {
    for (int st = 0; st < kStagedStages; ++st) mbar_init(&s_full[st], 1);
    fence_barrier_init();
  }
  __syncthreads();
  const int n = s_count[0] + s_count[1];
  if (ok) {
    const int at = (w == 1 ? s_count[0] : 0) + __popc(mask & ((1u << lane) - 1u));
    s_pair[at] = pair;
    s_x[at] = a.x_row<uint16_t>(row0 + tid, e);
    s_orow[at] = a.out_row<uint16_t>(row0 + tid, e);
    s_kept[at] = a.kept_row<uint16_t>(row0 + tid);
  }
  __syncthreads();
  if (n == 0) return;  // uniform

  // 2. the rows, kStagedStages in flight
  auto issue = [&](int i) {  // thread 0: row i's bytes into stage i % kStagedStages
    char* st = smem + (i % kStagedStages) * lay.stage;
    const Pair pr = s_pair[i];
    uint64_t* bar = &s_full[i % kStagedStages];
    mbar_expect_tx(bar, unsigned(lay.stage));
    bulk_g2s(st, static_cast<const uint16_t*>(a.a_pool) + int64_t(pr.a) * R * K,
             unsigned(lay.a_bytes), bar);
    bulk_g2s(st + lay.a_bytes, s_x[i], unsigned(lay.x_bytes), bar);
    bulk_g2s(st + lay.a_bytes + lay.x_bytes,
             static_cast<const uint16_t*>(a.b_pool) + int64_t(pr.b) * N * R,
             unsigned(lay.b_bytes), bar);
  };
  if (tid == 0)
    for (int i = 0; i < kStagedStages && i < n; ++i) issue(i);
  uint16_t o_cur[kStagedMaxCols], o_nxt[kStagedMaxCols];
  auto load_o = [&](uint16_t (&o)[kStagedMaxCols], int i) {
    const uint16_t* orow = s_orow[i];
#pragma unroll
    for (int m = 0; m < kStagedMaxCols; ++m) {
      const int64_t col = tid + int64_t(m) * kRowThreads;
      o[m] = col < N ? orow[col] : uint16_t(0);
    }
  };
  load_o(o_cur, 0);
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    if (i + 1 < n) load_o(o_nxt, i + 1);
    const char* st = smem + (i % kStagedStages) * lay.stage;
    const uint16_t* sA = reinterpret_cast<const uint16_t*>(st);
    const uint16_t* sx = reinterpret_cast<const uint16_t*>(st + lay.a_bytes);
    const uint16_t* sB = reinterpret_cast<const uint16_t*>(st + lay.a_bytes + lay.x_bytes);
    mbar_wait(&s_full[i % kStagedStages], unsigned(i / kStagedStages) & 1u);
    shrink_row<D, RB, true>(sA, sx, K, s_part, s_xa, s_kept[i]);
    float xa[R];
#pragma unroll
    for (int j = 0; j < R; ++j) xa[j] = s_xa[j];
    const float scale = s_pair[i].scale;
    uint16_t* orow = s_orow[i];
#pragma unroll
    for (int m = 0; m < kStagedMaxCols; ++m) {
      const int64_t col = tid + int64_t(m) * kRowThreads;
      if (col < N) {
        uint4 b[RB];
#pragma unroll
        for (int r = 0; r < RB; ++r) b[r] = ld16<true>(sB + col * R + 8 * r);
        orow[col] = f2h<D>(fold_add(h2f<D>(o_cur[m]), scale, expand_col<D, RB>(b, xa)));
      }
    }
    __syncthreads();  // stage i % kStagedStages read by every thread
    if (tid == 0 && i + kStagedStages < n) {
      fence_proxy_async_smem();
      issue(i + kStagedStages);
    }
#pragma unroll
    for (int m = 0; m < kStagedMaxCols; ++m) o_cur[m] = o_nxt[m];
  }
}

// CTAs per SM a rank's kernel is compiled for (its register budget, 128 a
// thread for two): two up to rank 32, one above (ranks 40-64 need more than
// 128 registers to keep their loads in flight without spilling). Measured on
// the H200: three CTAs (80 registers) spill and are slower
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

template <DType D, int RB>
cudaError_t staged_rb(const GatherArgs& a, cudaStream_t stream) {
  auto kernel = gather_rows_staged_kernel<D, RB>;
  const int smem = int(StagedLayout(a.R, a.K, a.N).smem());
  if (const cudaError_t err = ensure_smem(reinterpret_cast<const void*>(kernel), smem);
      err != cudaSuccess)
    return err;
  const int64_t ctas = std::max<int64_t>(sm_count(), (a.n_slots + kStagedMaxRows - 1) / kStagedMaxRows);
  const int rows_per_cta = int((a.n_slots + ctas - 1) / ctas);
  const dim3 grid(unsigned((a.n_slots + rows_per_cta - 1) / rows_per_cta), 1, 1);
  kernel<<<grid, kRowThreads, smem, stream>>>(a, rows_per_cta);
  return cudaPeekAtLastError();
}

template <DType D>
cudaError_t staged_dtype(const GatherArgs& a, cudaStream_t stream) {
  switch (a.R / 8) {
    case 1: return staged_rb<D, 1>(a, stream);
    case 2: return staged_rb<D, 2>(a, stream);
    case 3: return staged_rb<D, 3>(a, stream);
    case 4: return staged_rb<D, 4>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

// The staged kernel's shapes: two stages of a row's bytes in shared memory,
// at most kStagedMaxCols columns a thread, ranks up to 32, and at least two
// rows for every SM (fewer rows split their columns over CTAs instead).
// H200, rank 16, T = 64, kernel time against gather_rows_kernel (traced):
// Qwen3 down 16.3 -> 12.7 µs, DeepSeek gate 13.0 -> 10.7,
// DeepSeek down 15.9 -> 11.1, Qwen3 gate 11.9 -> 11.7 with 4 adapters.
bool staged_fits(const GatherArgs& a) {
  return a.R <= 32 && a.N <= int64_t(kRowThreads) * kStagedMaxCols &&
         StagedLayout(a.R, a.K, a.N).smem() <= kStagedMaxSmem &&
         a.n_slots >= 2 * int64_t(sm_count());
}

}  // namespace

bool gather_rows_fits(const GatherArgs& a) {
  return a.R % 8 == 0 && a.R <= kRowMaxRank && a.K % 8 == 0 && aligned16(a.x) &&
         aligned16(a.a_pool) && aligned16(a.b_pool);
}

cudaError_t launch_gather_rows(const GatherArgs& a, cudaStream_t stream) {
  if (staged_fits(a))
    return a.dtype == DType::kBf16 ? staged_dtype<DType::kBf16>(a, stream)
                                   : staged_dtype<DType::kF16>(a, stream);
  // Enough CTAs for every SM (few rows split their columns into chunks; each
  // chunk repeats the shrink, from L2) and at most kRowRounds column rounds.
  const int64_t quads = (a.N + kRowCols - 1) / kRowCols;
  const int64_t want = std::max<int64_t>(1, (sm_count() + a.n_slots - 1) / a.n_slots);
  const int64_t least = (quads + kRowThreads * kRowRounds - 1) / (kRowThreads * kRowRounds);
  const int64_t chunks0 = std::min<int64_t>({std::max(want, least), quads, 65535});
  const int64_t chunk_w = (quads + chunks0 - 1) / chunks0 * kRowCols;
  const int64_t chunks = (a.N + chunk_w - 1) / chunk_w;
  const bool nvec = a.N % kRowCols == 0 && outs_aligned(a, 8);
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
