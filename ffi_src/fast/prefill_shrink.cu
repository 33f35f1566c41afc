// Prefill fold, first launch: the shrink xa = round(x . A) of every row of
// the window that folds, written to the handler's xa scratch [te, R] (or, for
// the LoRA inside expert_matmul's GEMM, to the R columns of the row's table
// row in rows xa_ld wide: GroupedArgs::xa_by_adapter; there a second route
// of the same tables, GroupedArgs::xa2, shares the pass over x: gate and up;
// GroupedArgs::skip_cells leaves the rows of some cells out; each CTA first
// zeroes its rows of xa, and of xa2, over their whole width).
// prefill_expand.cu then folds round(xa . B) into base_out.
//
// A "batch" is up to MR = 8 * NRG rows of one tile that fold with one pair
// (one A block [R, K]). One CTA of kCellThreads runs a batch on the tensor
// cores: K streams in chunks of kCellKc through an S-stage cp.async pipeline
// (the chunk of A for RP ranks and of the batch's x rows, in shared memory,
// up to S chunks in flight; warp w copies rows w, w + 8, ... of a chunk, a
// 16-byte piece a lane, from row addresses resolved once a pass); warp w
// multiplies the 32-wide slice w of every chunk (mma m16n8k16, rank in M,
// rows in N, fp32); the 8 warp partials are summed in warp order and rounded
// into xa (activation dtype), then stored. Ranks go in passes of
// RP = 16 * SP, SP * NRG accumulator tiles per warp (8, or 16 at 32 ranks).
// One wave of CTAs, each owning an equal run of the window's rows, walks its
// run in tiles of up to MR rows of one expert; a tile's rows with one table
// row form a batch (one pass over K per adapter in the tile), so x is read
// once per row whatever the number of adapters in a tile. A tile that would
// cut a run of rows of one table row (a cell, with rows sorted by adapter)
// ends before it, so a cell of up to MR rows inside a CTA's run reads its A
// block once. A row's bits do not depend on the tiles or the runs.

#include "fast/fast_common.cuh"

namespace moelora {
namespace fast {
namespace {

constexpr int kCellThreads = 256;
constexpr int kCellWarps = kCellThreads / 32;
constexpr int kCellKc = kCellWarps * 32;        // k per stage: one 32-wide slice per warp
constexpr int kCellAStride = kCellKc * 2 + 32;  // bytes per A row: rows 2 apart 64 B apart in banks
constexpr int kCellXStride = kCellKc * 2 + 64;  // bytes per x row: adjacent rows 64 B apart
constexpr int kCellStageBudget = 96 * 1024;     // shared memory for the pipeline stages
constexpr int kCellMaxStages = 4;

// Shared memory of a cells CTA (byte offsets).
struct CellLayout {
  int mr, r16, rp, xs;  // rows per batch, R rounded to 16, ranks per pass, xa row stride
  int stage, stages;
  int off_stage, off_xa, off_list, off_xrow, off_orow, off_misc, off_src, total;
  __host__ __device__ CellLayout(int nrg, int sp, int R, int nstages) {
    mr = 8 * nrg;
    r16 = (R + 15) / 16 * 16;
    rp = r16 < 16 * sp ? r16 : 16 * sp;
    xs = r16 + 8;
    stage = rp * kCellAStride + mr * kCellXStride;
    stages = nstages;
    const int wbuf = kCellWarps * mr * rp * 4;  // warp partials alias the stages
    int o = 0;
    off_stage = o; o += stages * stage > wbuf ? stages * stage : wbuf;
    off_xa = o; o += (mr * xs * 2 + 15) / 16 * 16;
    off_list = o; o += 128 * 4;  // the tile's table rows and tokens
    off_xrow = o; o += mr * 4;
    off_orow = o; o += mr * 4;
    off_misc = o; o += 2 * kCellWarps * 4;
    off_src = o; o += (rp + mr) * 8;  // a pass's row addresses: A rows, then x rows
    total = (o + 127) / 128 * 128;
  }
  // Stages within kCellStageBudget, and at least two.
  static int stages_for(int nrg, int sp, int R) {
    const int s = kCellStageBudget / CellLayout(nrg, sp, R, 1).stage;
    return s < 2 ? 2 : (s > kCellMaxStages ? kCellMaxStages : s);
  }
};

// Wait until at most n committed groups are pending (n < kCellMaxStages).
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    default: cp_async_wait<3>(); break;
  }
}

// xa[q, :] = round(x[xrow[q]] . A[j]) for the batch's nrows rows (shared
// memory), ranks j < R: rows j < R0 of A, then rows j - R0 of A1 (two
// routes' blocks in one pass; A1 = A, R0 = R for one). Every thread of the
// CTA calls it; it ends with a barrier.
template <DType D, int NRG, int SP>
__device__ void cell_shrink(char* smem, const CellLayout& lay, int nrows, const uint16_t* x,
                            bool x_once, const uint16_t* A, const uint16_t* A1, int R0, int64_t K,
                            int R) {
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int* s_xrow = reinterpret_cast<const int*>(smem + lay.off_xrow);
  uint16_t* xa = reinterpret_cast<uint16_t*>(smem + lay.off_xa);
  char* stages = smem + lay.off_stage;
  float* wbuf = reinterpret_cast<float*>(stages);
  const int nch = int((K + kCellKc - 1) / kCellKc);
  const int nrg = (nrows + 7) / 8;
  const uint16_t** s_src = reinterpret_cast<const uint16_t**>(smem + lay.off_src);
  // Rows of x read once (x_once: not gathered, so each row is one sorted
  // row's) go first out of L2, so that streaming them keeps there the A
  // blocks that the cell's next tiles read again.
  const uint64_t a_policy = l2_evict_normal(), x_policy = x_once ? l2_evict_first() : a_policy;
  for (int p0 = 0; p0 < lay.r16; p0 += lay.rp) {
    const int rp = min(lay.rp, lay.r16 - p0);
    const int nslab = rp / 16;
    const int ncopy = rp + nrg * 8;  // stage rows: rp of A, then the row groups' x rows
    // the start of each stage row in global memory, or null (zero-filled)
    for (int ri = tid; ri < ncopy; ri += kCellThreads) {
      const uint16_t* src = nullptr;
      if (ri < rp) {
        const int j = p0 + ri;
        if (j < R) src = j < R0 ? A + int64_t(j) * K : A1 + int64_t(j - R0) * K;
      } else if (ri - rp < nrows) {
        src = x + int64_t(s_xrow[ri - rp]) * K;
      }
      s_src[ri] = src;
    }
    __syncthreads();
    // warp w: rows w, w + 8, ... of chunk c, lane l the 16 bytes at k = kb + 8 l
    auto issue = [&](int c, int buf) {
      char* st = stages + buf * lay.stage;
      const int64_t k = int64_t(c) * kCellKc + 8 * lane;
      for (int ri = w; ri < ncopy; ri += kCellWarps) {
        const uint16_t* src = s_src[ri];
        const bool valid = src != nullptr && k < K;
        char* dst = st + (ri < rp ? ri * kCellAStride : rp * kCellAStride + (ri - rp) * kCellXStride);
        cp_async16(dst + 16 * lane, valid ? src + k : A, valid, ri < rp ? a_policy : x_policy);
      }
    };
    float acc[SP][NRG][4];
#pragma unroll
    for (int s = 0; s < SP; ++s)
#pragma unroll
      for (int r = 0; r < NRG; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[s][r][i] = 0.f;
    for (int c = 0; c < lay.stages; ++c) {
      if (c < nch) issue(c, c);
      cp_async_commit();
    }
    const int kofs = (w * 32 + 8 * t) * 2;
    for (int c = 0; c < nch; ++c) {
      cp_async_wait_dyn(lay.stages - 1);  // chunk c has landed
      __syncthreads();
      const char* st = stages + (c % lay.stages) * lay.stage;
      uint4 a0[SP], a1[SP];
#pragma unroll
      for (int s = 0; s < SP; ++s) {
        if (s >= nslab) continue;
        a0[s] = *reinterpret_cast<const uint4*>(st + (16 * s + 2 * g) * kCellAStride + kofs);
        a1[s] = *reinterpret_cast<const uint4*>(st + (16 * s + 2 * g + 1) * kCellAStride + kofs);
      }
#pragma unroll
      for (int r = 0; r < NRG; ++r) {
        if (r >= nrg) continue;
        const uint4 xf = *reinterpret_cast<const uint4*>(st + rp * kCellAStride +
                                                         (r * 8 + g) * kCellXStride + kofs);
#pragma unroll
        for (int s = 0; s < SP; ++s) {
          if (s >= nslab) continue;
          Mma<D>::run(acc[s][r], a0[s].x, a1[s].x, a0[s].y, a1[s].y, xf.x, xf.y);
          Mma<D>::run(acc[s][r], a0[s].z, a1[s].z, a0[s].w, a1[s].w, xf.z, xf.w);
        }
      }
      __syncthreads();  // stage c % S is refilled next
      if (c + lay.stages < nch) issue(c + lay.stages, c % lay.stages);
      cp_async_commit();
    }
    cp_async_wait<0>();
    // C fragment: c0 (rank 2g, row 2t), c1 (2g, 2t+1), c2 (2g+1, 2t), c3 (2g+1, 2t+1)
#pragma unroll
    for (int s = 0; s < SP; ++s) {
      if (s >= nslab) continue;
#pragma unroll
      for (int r = 0; r < NRG; ++r) {
        if (r >= nrg) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int q = r * 8 + 2 * t + (i & 1);
          wbuf[(w * lay.mr + q) * rp + 16 * s + 2 * g + (i >> 1)] = acc[s][r][i];
        }
      }
    }
    __syncthreads();
    for (int e = tid; e < nrows * rp; e += kCellThreads) {
      const int q = e / rp, jl = e - q * rp;
      float v = wbuf[q * rp + jl];
#pragma unroll
      for (int ww = 1; ww < kCellWarps; ++ww) v += wbuf[(ww * lay.mr + q) * rp + jl];
      xa[q * lay.xs + p0 + jl] = f2h<D>(v);
    }
    __syncthreads();  // the next pass refills the stages (= wbuf)
  }
}

// Zero rows [r0, r1) of xa (rows ld wide, ld % 8 == 0: 16-byte pieces).
__device__ __forceinline__ void zero_rows(void* xa, int64_t ld, int64_t r0, int64_t r1) {
  if (r1 <= r0) return;
  uint4* p = reinterpret_cast<uint4*>(static_cast<uint16_t*>(xa) + r0 * ld);
  const int64_t n = (r1 - r0) * ld / 8;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) p[i] = make_uint4(0, 0, 0, 0);
}

// Store ranks [rank0, rank0 + R) of the batch's xa rows (shared memory) to
// the scratch rows orow[q], row stride ld, from column col.
__device__ __forceinline__ void store_xa(const char* smem, const CellLayout& lay, int nrows,
                                         uint16_t* xa_out, int R, int64_t ld, int64_t col,
                                         int rank0 = 0) {
  const uint16_t* xa = reinterpret_cast<const uint16_t*>(smem + lay.off_xa);
  const int* s_orow = reinterpret_cast<const int*>(smem + lay.off_orow);
  const int vecs = R / 8;  // R % 8 == 0: 16-byte pieces per row
  for (int i = threadIdx.x; i < nrows * vecs; i += blockDim.x) {
    const int q = i / vecs, v = i - q * vecs;
    *reinterpret_cast<uint4*>(xa_out + int64_t(s_orow[q]) * ld + col + 8 * v) =
        *reinterpret_cast<const uint4*>(xa + q * lay.xs + rank0 + 8 * v);
  }
}

template <DType D, int NRG, int SP>
__global__ void __launch_bounds__(kCellThreads, 2) grouped_shrink_kernel(const GroupedParams prm,
                                                                       const int stages) {
  constexpr int MR = 8 * NRG;
  static_assert(MR <= 64, "tile rows");
  extern __shared__ __align__(128) char smem[];
  const GroupedArgs& a = prm.a;
  // The expand launch may start now: it loads its base_out tiles and waits
  // for this grid's end (griddepcontrol.wait) before it reads xa.
  asm volatile("griddepcontrol.launch_dependents;");
  // a second route (a.xa2): its ranks follow the first's in every pass
  const bool two = a.xa2 != nullptr;
  const int64_t lo = max(int64_t(0), a.row_offset), hi = min(a.row_end, a.te);
  // This CTA's rows: [c_lo, c_hi), rows_per_cta of the window.
  const int64_t c_lo = lo + int64_t(blockIdx.x) * prm.rows_per_cta;
  const int64_t c_hi = min(hi, c_lo + prm.rows_per_cta);
  if (a.xa_by_adapter) {
    // Rows xa_ld wide, a row's shrink in its table row's R columns: zeros
    // everywhere else, and in the rows that fold nothing (the barriers
    // before store_xa order these stores before the CTA's shrinks).
    zero_rows(a.xa, a.xa_ld, c_lo, c_hi);
    if (two) zero_rows(a.xa2, a.xa_ld, c_lo, c_hi);
  }
  if (!cta_offsets_well_formed(a.expert_offsets, a.num_experts, a.te)) return;  // uniform
  const CellLayout lay(NRG, SP, int(two ? 2 * a.R : a.R), stages);
  const int tid = threadIdx.x, lane = tid & 31;
  const int E = prm.e_eff, R = int(a.R);
  int* s_misc = reinterpret_cast<int*>(smem + lay.off_misc);
  int* s_l = reinterpret_cast<int*>(smem + lay.off_list);  // [64] table row or -1
  int* s_tok = s_l + 64;
  int* s_xrow = reinterpret_cast<int*>(smem + lay.off_xrow);
  int* s_orow = reinterpret_cast<int*>(smem + lay.off_orow);
  // The experts whose spans meet the CTA's rows are consecutive (offsets
  // non-decreasing): found in one round trip, every thread testing its
  // share of the experts.
  auto span = [&](int e, int64_t* s0, int64_t* s1) {  // expert e's rows within [c_lo, c_hi)
    *s0 = min(max(int64_t(a.expert_offsets[e]), c_lo), c_hi);
    *s1 = min(max(int64_t(a.expert_offsets[e + 1]), *s0), c_hi);
  };
  int e_first = INT_MAX, e_last = -1;
  for (int e = tid; e < E; e += kCellThreads) {
    int64_t s0, s1;
    span(e, &s0, &s1);
    if (s0 < s1) {
      e_first = min(e_first, e);
      e_last = max(e_last, e);
    }
  }
  e_first = __reduce_min_sync(0xffffffffu, e_first);
  e_last = __reduce_max_sync(0xffffffffu, e_last);
  if (lane == 0) {
    s_misc[tid >> 5] = e_first;
    s_misc[kCellWarps + (tid >> 5)] = e_last;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kCellWarps; ++i) {
    e_first = min(e_first, s_misc[i]);
    e_last = max(e_last, s_misc[kCellWarps + i]);
  }
  __syncthreads();
  const RouteView& rt = a.route;
  const bool need_tok = a.x_gather || a.has_row_adapter;
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  uint16_t* xa_out = static_cast<uint16_t*>(a.xa);
  // tiles: up to MR consecutive rows of one expert, in row order
  int e = e_first;
  int64_t r0 = 0, st = 0, en = 0;
  if (e <= e_last) {
    span(e, &st, &en);
    r0 = st;
  }
  for (int used = 0; e <= e_last; r0 += used) {
    if (r0 >= en) {  // the next expert with rows here (uniform over the CTA)
      if (++e > e_last) break;
      span(e, &st, &en);
      r0 = st;
      used = 0;
      continue;
    }
    const int cnt = int(min(int64_t(MR), en - r0));
    if (tid < 64) {
      int lv = -1, tok = 0;
      if (tid < cnt) {
        int64_t tk, ad;
        if (grouped_row_adapter(a.sorted_token_ids, a.row_adapter, a.has_row_adapter,
                                a.num_tokens, a.x_gather, r0 + tid, &tk, &ad)) {
          const int64_t ll = rt.num_loras == 1 ? 0 : ad;
          if (ad >= 0 && ll < rt.num_loras) lv = int(ll);
          tok = need_tok ? int(tk) : 0;
        }
      }
      s_l[tid] = lv;
      s_tok[tid] = tok;
    }
    __syncthreads();
    // A tile cut before its expert's end leaves its last run of one table
    // row (when it does not fill the tile) to the next tile, which starts
    // there: with rows sorted by adapter, a tile then holds whole cells and
    // a cell of up to MR rows reads its A block once.
    used = cnt;
    if (r0 + cnt < en) {
      const int last = s_l[cnt - 1];
      const unsigned d0 = __ballot_sync(0xffffffffu, lane < cnt && s_l[lane] != last);
      const unsigned d1 = __ballot_sync(0xffffffffu, lane + 32 < cnt && s_l[lane + 32] != last);
      if (d1 | d0) used = d1 ? 64 - __clz(d1) : 32 - __clz(d0);
    }
    const int v0 = lane < used ? s_l[lane] : -1, v1 = lane + 32 < used ? s_l[lane + 32] : -1;
    int prev = -1;
    for (;;) {
      // the next table row present in the tile (every warp computes the same)
      const int m0 = v0 > prev ? v0 : INT_MAX, m1 = v1 > prev ? v1 : INT_MAX;
      const int cur = __reduce_min_sync(0xffffffffu, min(m0, m1));
      if (cur == INT_MAX) break;
      prev = cur;
      Pair pair, pair2;
      const bool fold1 = resolve_pair(rt, cur, e, &pair) &&
                         !(a.skip_cells && a.skip_cells[cur * rt.n_experts + e]);
      const bool fold2 = two && resolve_pair(a.route2, cur, e, &pair2) &&
                         !(a.skip_cells2 && a.skip_cells2[cur * a.route2.n_experts + e]);
      if (!fold1 && !fold2) continue;
      const unsigned b0 = __ballot_sync(0xffffffffu, v0 == cur);
      const unsigned b1 = __ballot_sync(0xffffffffu, v1 == cur);
      const int nrows = __popc(b0) + __popc(b1);
      if (tid < 64) {
        const bool mine = tid < 32 ? ((b0 >> tid) & 1u) : ((b1 >> (tid - 32)) & 1u);
        if (mine) {
          const int pos = tid < 32 ? __popc(b0 & ((1u << tid) - 1u))
                                   : __popc(b0) + __popc(b1 & ((1u << (tid - 32)) - 1u));
          const int r = int(r0 + tid);
          s_orow[pos] = r;
          s_xrow[pos] = a.x_gather ? s_tok[tid] : r;
        }
      }
      __syncthreads();
      // a route whose pair does not fold reads the other's block (finite
      // values) and stores nothing
      const uint16_t* A1 =
          fold1 ? static_cast<const uint16_t*>(a.a_pool) + int64_t(pair.a) * R * a.K : nullptr;
      const uint16_t* A2 =
          fold2 ? static_cast<const uint16_t*>(a.a_pool2) + int64_t(pair2.a) * R * a.K : A1;
      if (!fold1) A1 = A2;
      cell_shrink<D, NRG, SP>(smem, lay, nrows, x, !a.x_gather, A1, A2, R, a.K, two ? 2 * R : R);
      const int64_t ld = a.xa_ld > 0 ? a.xa_ld : R, col = a.xa_by_adapter ? int64_t(cur) * R : 0;
      if (fold1) store_xa(smem, lay, nrows, xa_out, R, ld, col);
      if (fold2) store_xa(smem, lay, nrows, static_cast<uint16_t*>(a.xa2), R, ld, col, R);
      __syncthreads();  // s_xrow, s_orow and xa are rewritten by the next pass
    }
    __syncthreads();  // s_l and s_tok are rewritten by the next tile
  }
}

template <DType D, int NRG, int SP>
cudaError_t grouped_shrink_nrg(const GroupedArgs& a, cudaStream_t stream) {
  constexpr int MR = 8 * NRG;
  GroupedParams prm = {};
  prm.a = a;
  const int64_t lo = std::max<int64_t>(0, a.row_offset), hi = std::min<int64_t>(a.row_end, a.te);
  prm.e_eff = int(std::min<int64_t>(a.route.n_experts, a.num_experts));
  const int ranks = int(a.xa2 != nullptr ? 2 * a.R : a.R);  // per pass over x
  const int stages = CellLayout::stages_for(NRG, SP, ranks);
  const CellLayout lay(NRG, SP, ranks, stages);
  auto kernel = grouped_shrink_kernel<D, NRG, SP>;
  if (const cudaError_t err = ensure_smem(reinterpret_cast<const void*>(kernel), lay.total);
      err != cudaSuccess)
    return err;
  int per_sm = 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kCellThreads, lay.total) !=
          cudaSuccess ||
      per_sm < 1)
    per_sm = 1;
  // One wave of resident CTAs with equal shares of the window's rows (a
  // multiple of 32), so the rows, not a count of tiles, set a CTA's work:
  // tiles dealt round-robin to the CTAs would leave most SMs idle in the
  // last round whenever the tiles are just past a multiple of the CTAs.
  const int64_t resident = int64_t(sm_count()) * per_sm;
  const int64_t share = (hi - lo + resident - 1) / resident;
  prm.rows_per_cta = std::max<int64_t>(MR, (share + 31) / 32 * 32);
  const int64_t ctas = (hi - lo + prm.rows_per_cta - 1) / prm.rows_per_cta;
  kernel<<<unsigned(ctas), kCellThreads, lay.total, stream>>>(prm, stages);
  return cudaPeekAtLastError();
}

}  // namespace

// Tiles of 64 rows at rank <= 32, 32 at rank <= 64, else 16: a warp's
// accumulators are 8 tensor-core tiles (16, 32 and 64 ranks a pass), 16 at
// 32 ranks (gate and up's shared pass at rank 16), whose 64-row tiles hold a
// cell of T = 4096 (~64 rows) where 32-row tiles read its A pair two or
// three times. At rank 64 the 32-row tiles read each A block half as often
// as 16-row tiles for one more pass over x (H200, T = 4096, 4 adapters:
// 1-15 % off each fold). The caller checks grouped_split_fits and that the window
// [max(0, row_offset), min(row_end, te)) and min(route.n_experts,
// num_experts) are not empty. With a second route (a.xa2) the ranks of a
// pass are both routes' (2 R): x is read once for both.
cudaError_t launch_grouped_shrink(const GroupedArgs& a, cudaStream_t stream) {
  const bool bf16 = a.dtype == DType::kBf16;
  const int64_t ranks = a.xa2 != nullptr ? 2 * a.R : a.R;
  if (ranks <= 16)
    return bf16 ? grouped_shrink_nrg<DType::kBf16, 8, 1>(a, stream)
                : grouped_shrink_nrg<DType::kF16, 8, 1>(a, stream);
  if (ranks <= 32)
    return bf16 ? grouped_shrink_nrg<DType::kBf16, 8, 2>(a, stream)
                : grouped_shrink_nrg<DType::kF16, 8, 2>(a, stream);
  if (ranks <= 64)
    return bf16 ? grouped_shrink_nrg<DType::kBf16, 4, 2>(a, stream)
                : grouped_shrink_nrg<DType::kF16, 4, 2>(a, stream);
  return bf16 ? grouped_shrink_nrg<DType::kBf16, 2, 4>(a, stream)
              : grouped_shrink_nrg<DType::kF16, 2, 4>(a, stream);
}

}  // namespace fast
}  // namespace moelora
