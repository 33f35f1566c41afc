// Prefill fold, second launch: out[r] = round(out[r] + s * round(xa[r] . B))
// for every row of the window that folds, xa from prefill_shrink.cu; and
// launch_grouped_fast, which picks the kernels for a grouped fold.
//
// The expand streams base_out. One CTA owns a tile of kExpRows consecutive
// sorted rows, whatever the experts and adapters in it, and walks a share of
// its kExpCols-column chunks. Sorted row r reads and writes base_out row
// out_rows[r] (r without out_rows): the tile's rows of base_out need not be
// consecutive.
//  1. The tile's out rows are read into shared memory, then the first chunks
//     of those base_out rows start their copy into shared memory (cp.async,
//     16-byte pieces) before anything else. A row whose out row lies outside
//     base_out is neither loaded nor stored (it folds nothing).
//  2. Once per tile, the rows resolve their (adapter, expert) cell (the expert
//     by a binary search of expert_offsets in shared memory) and are ranked
//     by cell: a segment of slots per cell. After griddepcontrol.wait (the
//     shrink grid has ended) the xa rows are loaded in slot order.
//  3. Per chunk, in a kExpStages-stage pipeline (the copy of chunk i + S - 1
//     overlaps the work on chunk i): each segment's delta = round(xa . B) on
//     the tensor cores (mma m16n8k16: 16 slots x 8 columns x 16 ranks), folded
//     into the chunk in shared memory; the rows that fold are stored in
//     16-byte vectors, the other rows are never written. Up to rank 64 a
//     segment's B fragments are held for all its 16-slot groups, and (but at
//     rank 48, whose registers would spill) the first segment's of chunk
//     i + 1 are loaded while chunk i is stored, so no chunk waits on them
//     (H200, T = 4096: 0-7 % off each rank-16 fold; rank 64, with the
//     fragments held instead of loaded per group and rank step, 8-27 %).

#include "fast/fast_common.cuh"

namespace moelora {
namespace fast {
namespace {

constexpr int kExpThreads = 256;
constexpr int kExpWarps = kExpThreads / 32;
constexpr int kExpRows = kTileRows;                   // rows per tile
constexpr int kExpCols = 128;                         // output columns per chunk
constexpr int kExpStages = 3;                         // chunks in flight per CTA
constexpr int kExpOStride = kExpCols + 8;             // chunk row stride in shared memory
constexpr int kExpStage = kExpRows * kExpOStride;     // elements per stage
constexpr int kExpPieces = kExpRows * kExpCols / 8;   // 16-byte pieces per chunk
constexpr int kExpPiecesPerThread = kExpPieces / kExpThreads;
constexpr int kExpRowVecs = kExpCols / 8;             // 16-byte pieces per chunk row
constexpr int kExpNTiles = kExpCols / 8 / kExpWarps;  // 8-column mma tiles per warp
constexpr int kExpMaxOffsets = 1024;                  // expert_offsets kept in shared memory
// CTAs per SM (launch bounds) of the kernel holding the B fragments of RK
// rank steps: 3, or 2 at RK = 4 (R = 64), whose fragments would spill under
// the 3-CTA register budget.
__host__ __device__ constexpr int expand_resident(int RK) { return RK == 4 ? 2 : 3; }
// The RK the kernel is instantiated with for R rounded up to 16.
__host__ __device__ constexpr int expand_rk(int r16) { return r16 <= 64 ? r16 / 16 : 0; }

struct ExpandParams {
  GroupedArgs a;
  int64_t lo, hi;  // the window, clipped to [0, te)
  int r16, xs;     // R rounded up to 16; xa row stride in shared memory (elements)
  int chunks;      // kExpCols-column chunks of a row
};

// Shared memory: kExpStages chunks of the base_out tile [kExpRows][kExpOStride]
// and xa [kExpRows][xs] (activation dtype), expert_offsets (up to
// kExpMaxOffsets), then the per-row and per-slot metadata (10 arrays of
// kExpRows ints, the kExpRows + 1 segment starts and 6 counters).
struct ExpandLayout {
  int off_out, off_xa, off_offsets, off_meta, total;
  __host__ __device__ explicit ExpandLayout(int xs) {
    off_out = 0;
    off_xa = off_out + kExpStages * kExpStage * 2;
    off_offsets = off_xa + kExpRows * xs * 2;
    off_meta = off_offsets + kExpMaxOffsets * 4;
    total = off_meta + (11 * kExpRows + 8) * 4;
  }
};

// The expert of row r: the last e with offsets[e] <= r, when r < offsets[E]
// (offsets checked well formed: non-decreasing).
__device__ __forceinline__ int64_t row_expert(const int32_t* offsets, int64_t E, int64_t r) {
  if (r < offsets[0] || r >= offsets[E]) return -1;
  int64_t lo = 0, hi = E;  // offsets[lo] <= r < offsets[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= r) lo = mid; else hi = mid;
  }
  return lo;
}

// Lane (g, t)'s B fragment of n8 tile u for the 16-rank step at ks (B:
// one pool slot [N, R]): column c0 + 8 (w + kExpWarps u) + g, ranks ks + 4t
// .. + 3, zero past the rank or the last column.
__device__ __forceinline__ uint2 b_frag(const uint16_t* B, int64_t c0, int64_t N, int R, int ks,
                                        int u, int w, int g, int t) {
  const bool kv = ks + 4 * t < R;  // R % 8 == 0: the 4 ranks are all in or all out
  const int64_t n = c0 + 8 * (w + kExpWarps * u) + g;
  return kv && n < N ? __ldg(reinterpret_cast<const uint2*>(B + n * R + ks + 4 * t))
                     : make_uint2(0u, 0u);
}

// The B fragments of one segment for a chunk: RK 16-rank steps of b_frag.
template <int RK>
struct BFrags {
  uint2 v[RK > 0 ? RK : 1][kExpNTiles];

  __device__ __forceinline__ void load(const uint16_t* b_pool, int slot, int64_t c0, int64_t N,
                                       int R, int w, int g, int t) {
    const uint16_t* B = b_pool + int64_t(slot) * N * R;
#pragma unroll
    for (int kq = 0; kq < (RK > 0 ? RK : 1); ++kq)
#pragma unroll
      for (int u = 0; u < kExpNTiles; ++u) v[kq][u] = b_frag(B, c0, N, R, 16 * kq, u, w, g, t);
  }
};

// RK: rank steps of 16 with the B fragments held per segment (1-4: R <= 64),
// or 0: loaded per 16-slot tile (any rank).
template <DType D, int RK>
__global__ void __launch_bounds__(kExpThreads, expand_resident(RK))
    grouped_expand_kernel(const ExpandParams p) {
  extern __shared__ __align__(128) char smem[];
  const GroupedArgs& a = p.a;
  const ExpandLayout lay(p.xs);
  uint16_t* s_out = reinterpret_cast<uint16_t*>(smem + lay.off_out);
  uint16_t* s_xa = reinterpret_cast<uint16_t*>(smem + lay.off_xa);
  int* s_key = reinterpret_cast<int*>(smem + lay.off_meta);  // [rows] cell or INT_MAX
  int* s_b = s_key + kExpRows;                               // [rows] B pool slot
  float* s_scale = reinterpret_cast<float*>(s_b + kExpRows);  // [rows]
  int* s_orow = reinterpret_cast<int*>(s_scale + kExpRows);  // [rows] out row, or -1
  int* s_slot = s_orow + kExpRows;                           // [rows] slot of the row
  int* s_row = s_slot + kExpRows;                            // [slots] row of the slot
  int* s_part = s_row + kExpRows;                            // [4][rows] partial ranks
  int* s_seg = s_part + 4 * kExpRows;                        // [segments + 1] first slots
  int* s_misc = s_seg + kExpRows + 1;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int64_t rb = p.lo + int64_t(blockIdx.x) * kExpRows;
  const int64_t N = a.N;
  uint16_t* out = static_cast<uint16_t*>(a.out);
  // this CTA's chunks: blockIdx.y, blockIdx.y + gridDim.y, ...
  const int my_chunks = (p.chunks - int(blockIdx.y) + int(gridDim.y) - 1) / int(gridDim.y);
  auto issue = [&](int i) {  // chunk i of this CTA into stage i % kExpStages
    if (i < my_chunks) {
      const int64_t c0 = int64_t(blockIdx.y + i * gridDim.y) * kExpCols;
      uint16_t* st = s_out + (i % kExpStages) * kExpStage;
#pragma unroll
      for (int j = 0; j < kExpPiecesPerThread; ++j) {
        const int piece = tid + j * kExpThreads;
        const int q = piece / kExpRowVecs, v = piece % kExpRowVecs;
        const int orow = s_orow[q];
        const int64_t col = c0 + 8 * v;
        const bool valid = orow >= 0 && col < N;  // N % 8 == 0: a piece is all in or all out
        cp_async16(st + q * kExpOStride + 8 * v, valid ? out + int64_t(orow) * N + col : out,
                   valid);
      }
    }
    cp_async_commit();
  };

  // 1. the tile's out rows (-1: past the window or outside base_out), then
  // the first chunks in flight
  if (tid < kExpRows) {
    const int64_t r = rb + tid;
    int64_t orow;
    s_orow[tid] = r < p.hi && grouped_out_row(a.out_rows, a.m, r, &orow) ? int(orow) : -1;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kExpStages - 1; ++i) issue(i);
  // expert_offsets in shared memory when they fit (the binary searches below)
  const int32_t* offsets = a.expert_offsets;
  if (a.num_experts < kExpMaxOffsets) {
    int32_t* s_off = reinterpret_cast<int32_t*>(smem + lay.off_offsets);
    for (int64_t e = tid; e <= a.num_experts; e += kExpThreads) s_off[e] = offsets[e];
    offsets = s_off;  // visible after the barrier of cta_offsets_well_formed
  }
  if (!cta_offsets_well_formed(a.expert_offsets, a.num_experts, a.te)) {
    cp_async_wait<0>();  // no copy outlives the CTA
    return;  // uniform
  }

  // 2. the rows' cells, ranked (4 threads a row), segments, xa
  if (tid < kExpRows) {
    const int64_t r = rb + tid;
    int key = INT_MAX, b = 0;
    float scale = 0.f;
    if (s_orow[tid] >= 0) {
      const int64_t e = row_expert(offsets, a.num_experts, r);
      int64_t tk, ad;
      Pair pair;
      if (e >= 0 &&
          grouped_row_adapter(a.sorted_token_ids, a.row_adapter, a.has_row_adapter, a.num_tokens,
                              a.x_gather, r, &tk, &ad) &&
          resolve_pair(a.route, ad, e, &pair)) {
        const int64_t l = a.route.num_loras == 1 ? 0 : ad;
        key = int(l * a.route.n_experts + e);
        b = pair.b;
        scale = pair.scale;
      }
    }
    s_key[tid] = key;
    s_b[tid] = b;
    s_scale[tid] = scale;
  }
  __syncthreads();
  rank_tile_rows(s_key, s_part, s_slot, s_row, s_seg, s_misc);
  const int n_fold = s_misc[0], n_seg = s_misc[1];
  if (n_fold == 0) {  // uniform: nothing of this tile folds
    cp_async_wait<0>();
    return;
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int R = int(a.R), xs = p.xs, vecs = p.r16 / 8;
  const uint16_t* xa_g = static_cast<const uint16_t*>(a.xa);
  for (int i = tid; i < kExpRows * vecs; i += kExpThreads) {
    const int s = i / vecs, v = i - s * vecs;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (s < n_fold && 8 * v < R)
      val = *reinterpret_cast<const uint4*>(xa_g + (rb + s_row[s]) * R + 8 * v);
    *reinterpret_cast<uint4*>(s_xa + s * xs + 8 * v) = val;
  }

  // 3. the chunks
  const int g = lane >> 2, t = lane & 3;
  const uint16_t* b_pool = static_cast<const uint16_t*>(a.b_pool);
  // RK > 0: a segment's B fragments (RK 16-rank steps) are loaded once for
  // all its 16-slot tiles, the next segment's while this one folds, and the
  // first segment's of the next chunk while this chunk is stored
  constexpr bool kAhead = RK > 0 && RK != 3;  // RK = 3 would spill under its 3-CTA budget
  BFrags<RK> first;
  const int b_first = s_b[s_row[s_seg[0]]];
  if constexpr (kAhead) first.load(b_pool, b_first, int64_t(blockIdx.y) * kExpCols, N, R, w, g, t);
  for (int i = 0; i < my_chunks; ++i) {
    cp_async_wait<kExpStages - 2>();  // chunk i has landed (this thread's pieces)
    __syncthreads();                  // everyone's pieces, and chunk i - 1 is stored
    issue(i + kExpStages - 1);        // into the stage chunk i - 1 used
    const int64_t c0 = int64_t(blockIdx.y + i * gridDim.y) * kExpCols;
    uint16_t* st = s_out + (i % kExpStages) * kExpStage;
    BFrags<RK> cur, nxt;
    if constexpr (kAhead) cur = first;
    else if constexpr (RK > 0) cur.load(b_pool, b_first, c0, N, R, w, g, t);
    for (int sg = 0; sg < n_seg; ++sg) {
      const int s0 = s_seg[sg], s1 = s_seg[sg + 1];
      const uint16_t* B = b_pool + int64_t(s_b[s_row[s0]]) * N * R;
      if constexpr (RK > 0) {
        if (sg + 1 < n_seg) nxt.load(b_pool, s_b[s_row[s_seg[sg + 1]]], c0, N, R, w, g, t);
      }
      for (int mt = s0 / 16; mt * 16 < s1; ++mt) {
        float acc[kExpNTiles][4];
#pragma unroll
        for (int u = 0; u < kExpNTiles; ++u)
#pragma unroll
          for (int k = 0; k < 4; ++k) acc[u][k] = 0.f;
        if constexpr (RK > 0) {
#pragma unroll
          for (int kq = 0; kq < RK; ++kq) {
            const int ks = 16 * kq;
            const uint2 xlo =
                *reinterpret_cast<const uint2*>(s_xa + (mt * 16 + g) * xs + ks + 4 * t);
            const uint2 xhi =
                *reinterpret_cast<const uint2*>(s_xa + (mt * 16 + g + 8) * xs + ks + 4 * t);
#pragma unroll
            for (int u = 0; u < kExpNTiles; ++u)
              Mma<D>::run(acc[u], xlo.x, xhi.x, xlo.y, xhi.y, cur.v[kq][u].x, cur.v[kq][u].y);
          }
        } else {
          for (int ks = 0; ks < p.r16; ks += 16) {
            // k order within the step: lane t holds ranks ks + 4t .. ks + 4t + 3
            const uint2 xlo =
                *reinterpret_cast<const uint2*>(s_xa + (mt * 16 + g) * xs + ks + 4 * t);
            const uint2 xhi =
                *reinterpret_cast<const uint2*>(s_xa + (mt * 16 + g + 8) * xs + ks + 4 * t);
#pragma unroll
            for (int u = 0; u < kExpNTiles; ++u) {
              const uint2 bv = b_frag(B, c0, N, R, ks, u, w, g, t);
              Mma<D>::run(acc[u], xlo.x, xhi.x, xlo.y, xhi.y, bv.x, bv.y);
            }
          }
        }
        // c0, c1: slot mt*16 + g, columns 2t, 2t+1; c2, c3: slot + 8
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int s = mt * 16 + g + 8 * h;
          if (s < s0 || s >= s1) continue;
          const int q = s_row[s];
          const float scale = s_scale[q];
#pragma unroll
          for (int u = 0; u < kExpNTiles; ++u) {
            uint32_t* o =
                reinterpret_cast<uint32_t*>(st + q * kExpOStride + 8 * (w + kExpWarps * u) + 2 * t);
            *o = fold_pair<D>(*o, scale, acc[u][2 * h], acc[u][2 * h + 1]);
          }
        }
      }
      if constexpr (RK > 0) cur = nxt;
    }
    if constexpr (kAhead) {
      if (i + 1 < my_chunks)
        first.load(b_pool, b_first, c0 + int64_t(gridDim.y) * kExpCols, N, R, w, g, t);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kExpPiecesPerThread; ++j) {
      const int piece = tid + j * kExpThreads;
      const int q = piece / kExpRowVecs, v = piece % kExpRowVecs;
      const int64_t col = c0 + 8 * v;
      if (col >= N || s_key[q] == INT_MAX) continue;  // INT_MAX: past the window too
      __stcs(reinterpret_cast<uint4*>(out + int64_t(s_orow[q]) * N + col),
             *reinterpret_cast<const uint4*>(st + q * kExpOStride + 8 * v));
    }
  }
  cp_async_wait<0>();
}

template <DType D>
cudaError_t grouped_expand(const GroupedArgs& a, int64_t lo, int64_t hi, cudaStream_t stream) {
  ExpandParams p;
  p.a = a;
  p.lo = lo;
  p.hi = hi;
  p.r16 = int((a.R + 15) / 16 * 16);
  p.xs = p.r16 + 8;
  p.chunks = int((a.N + kExpCols - 1) / kExpCols);
  const ExpandLayout lay(p.xs);
  void (*kernel)(ExpandParams) = p.r16 == 16   ? grouped_expand_kernel<D, 1>
                                 : p.r16 == 32 ? grouped_expand_kernel<D, 2>
                                 : p.r16 == 48 ? grouped_expand_kernel<D, 3>
                                 : p.r16 == 64 ? grouped_expand_kernel<D, 4>
                                               : grouped_expand_kernel<D, 0>;
  if (const cudaError_t err = ensure_smem(reinterpret_cast<const void*>(kernel), lay.total);
      err != cudaSuccess)
    return err;
  // Two waves of resident CTAs: each tile's chunks are split over `groups`
  // CTAs, the fewest that give every SM work for two rounds.
  const int64_t tiles = (hi - lo + kExpRows - 1) / kExpRows;
  const int64_t want = 2 * int64_t(sm_count()) * expand_resident(expand_rk(p.r16));
  const int64_t groups = std::min<int64_t>({(want + tiles - 1) / tiles, p.chunks, 65535});
  // the expand's CTAs may start while the shrink runs; griddepcontrol.wait
  // orders their xa reads after it
  return launch_dependent(kernel, dim3(unsigned(tiles), unsigned(groups), 1), kExpThreads,
                          lay.total, stream, a.pdl, p);
}

}  // namespace

// The split kernels read x, A, B and xa with 16-byte vectors, base_out with
// 16-byte vectors of whole rows, and keep row ids (sorted and out) and cells
// in int.
bool grouped_split_fits(const GroupedArgs& a) {
  return a.K % 8 == 0 && a.N % 8 == 0 && a.R % 8 == 0 && a.R <= kMaxRank && aligned16(a.x) &&
         aligned16(a.a_pool) && aligned16(a.b_pool) && aligned16(a.out) && aligned16(a.xa) &&
         a.te < INT_MAX && a.m < INT_MAX && a.route.num_loras * a.route.n_experts < INT_MAX &&
         (a.N + kExpCols - 1) / kExpCols < INT_MAX;
}

}  // namespace fast

// bf16/f16 folds that fit the split kernels run the shrink then the expand;
// others take the simple kernels; f32 takes rows_f32.cu.
cudaError_t launch_grouped_fast(const GroupedArgs& args, cudaStream_t stream) {
  using namespace fast;
  if (args.te <= 0 || args.N <= 0 || args.K <= 0 || args.R <= 0) return cudaSuccess;
  if (args.dtype == DType::kF32) return launch_grouped_f32(args, stream);
  if (!grouped_split_fits(args)) return launch_grouped_simple(args, stream);
  const int64_t lo = std::max<int64_t>(0, args.row_offset);
  const int64_t hi = std::min<int64_t>(args.row_end, args.te);
  if (hi <= lo || std::min<int64_t>(args.route.n_experts, args.num_experts) <= 0)
    return cudaSuccess;
  if (const cudaError_t err = launch_grouped_shrink(args, stream); err != cudaSuccess) return err;
  return args.dtype == DType::kBf16 ? grouped_expand<DType::kBf16>(args, lo, hi, stream)
                                    : grouped_expand<DType::kF16>(args, lo, hi, stream);
}

}  // namespace moelora
