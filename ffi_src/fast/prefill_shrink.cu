// Prefill fold, first launch: the shrink xa = round(x . A) of every row of
// the window that folds, written to the handler's xa scratch [te, R].
// prefill_expand.cu then folds round(xa . B) into base_out.
//
// Persistent CTAs walk tiles of kTileRows rows of one expert span (in
// round-major order over the experts). Per tile:
//  1. every row resolves its table row (adapter) and pair; the rows are
//     ranked by table row into slots (rank_tile_rows), a segment per adapter;
//  2. a "unit" is a segment's 16 ranks [16j, 16j + 16); a pass takes up to
//     kShrUnits consecutive units (their A rows) and the x rows of their
//     segments, and streams K through a kShrStages-stage cp.async pipeline in
//     chunks of kShrKc. A pass has up to 32 "pairs" (unit, group of 8 slots
//     that meets the unit's segment); each warp multiplies a run of
//     consecutive pairs (one A fragment load per unit) over the whole of K
//     (mma m16n8k16: ranks in M, rows in N, fp32, k in order), so a tile's x
//     rows stream once whatever its adapters (R <= 16: one pass for up to 4
//     adapters);
//  3. the sums are rounded into xa in shared memory, then the folding rows
//     are stored in 16-byte vectors.

#include "fast/fast_common.cuh"

namespace moelora {
namespace fast {
namespace {

constexpr int kShrThreads = 256;
constexpr int kShrWarps = kShrThreads / 32;
constexpr int kShrKc = 64;                     // k per pipeline stage
constexpr int kShrStages = 3;
constexpr int kShrUnits = 4;                   // 16-rank units (A rows / 16) per pass
constexpr int kShrPairsPerWarp = 4;
constexpr int kShrMaxPairs = kShrWarps * kShrPairsPerWarp;
// Stage row strides (bytes): lanes 0-7 of an mma operand load read A rows 2
// apart (160 B * 2 = 64 B mod 128) or x rows 1 apart (192 B = 64 B mod 128):
// no bank conflicts.
constexpr int kShrAStride = kShrKc * 2 + 32;
constexpr int kShrXStride = kShrKc * 2 + 64;
constexpr int kShrXOffset = kShrUnits * 16 * kShrAStride;  // A rows, then x rows
constexpr int kShrStageBytes = kShrXOffset + kTileRows * kShrXStride;
constexpr int kShrResident = 3;

// Shared memory: the stages, xa [kTileRows][xs] (activation dtype), then the
// tile's metadata.
struct ShrinkLayout {
  int xs, off_xa, off_meta, total;
  __host__ __device__ explicit ShrinkLayout(int r16) {
    xs = r16 + 8;
    off_xa = kShrStages * kShrStageBytes;
    off_meta = off_xa + kTileRows * xs * 2;
    total = off_meta + (10 * kTileRows + 16) * 4;
  }
};

// The units [u0, u1) of the pass that starts at unit u0 (units are (segment,
// 16-rank slab) in segment-major order), and its pair count. Pairs are
// numbered unit by unit.
__device__ __forceinline__ void plan_pass(const int* s_seg, int n_seg, int slabs, int u0, int* u1,
                                          int* npairs) {
  int u = u0, pairs = 0;
  while (u < n_seg * slabs && u - u0 < kShrUnits) {
    const int sg = u / slabs;
    const int groups = (s_seg[sg + 1] - 1) / 8 - s_seg[sg] / 8 + 1;
    if (pairs + groups > kShrMaxPairs) break;
    pairs += groups;
    ++u;
  }
  *u1 = u;
  *npairs = pairs;
}

// Pair p of the pass [u0, u1): its unit and group of 8 slots.
__device__ __forceinline__ void pass_pair(const int* s_seg, int slabs, int u0, int u1, int p,
                                          int* unit, int* group) {
  for (int u = u0; u < u1; ++u) {
    const int sg = u / slabs;
    const int g0 = s_seg[sg] / 8, groups = (s_seg[sg + 1] - 1) / 8 - g0 + 1;
    if (p < groups) {
      *unit = u;
      *group = g0 + p;
      return;
    }
    p -= groups;
  }
  *unit = u0;
  *group = 0;
}

template <DType D>
__global__ void __launch_bounds__(kShrThreads, kShrResident)
    grouped_shrink_kernel(const GroupedParams prm) {
  extern __shared__ __align__(128) char smem[];
  const GroupedArgs& a = prm.a;
  // The expand launch may start now: it loads its base_out tiles and waits
  // for this grid's end (griddepcontrol.wait) before it reads xa.
  asm volatile("griddepcontrol.launch_dependents;");
  if (!cta_offsets_well_formed(a.expert_offsets, a.num_experts, a.te)) return;  // uniform
  const int R = int(a.R), r16 = (R + 15) / 16 * 16, slabs = r16 / 16;
  const ShrinkLayout lay(r16);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  uint16_t* s_xa = reinterpret_cast<uint16_t*>(smem + lay.off_xa);
  int* s_key = reinterpret_cast<int*>(smem + lay.off_meta);  // [rows] table row or INT_MAX
  int* s_aslot = s_key + kTileRows;                          // [rows] A pool slot
  int* s_xrow = s_aslot + kTileRows;                         // [rows] x row
  int* s_slot = s_xrow + kTileRows;
  int* s_row = s_slot + kTileRows;
  int* s_part = s_row + kTileRows;                           // [4][rows]
  int* s_seg = s_part + 4 * kTileRows;                       // [segments + 1]
  int* s_misc = s_seg + kTileRows + 1;                       // [8]
  const int64_t lo = max(int64_t(0), a.row_offset), hi = min(a.row_end, a.te);
  const int E = prm.e_eff;
  const int64_t K = a.K;
  auto span = [&](int e, int64_t* start, int64_t* len) {
    int64_t s0 = a.expert_offsets[e], s1 = a.expert_offsets[e + 1];
    s0 = min(max(s0, lo), hi);
    s1 = min(max(s1, s0), hi);
    *start = s0;
    *len = s1 - s0;
  };
  int local_max = 0;
  for (int e = tid; e < E; e += kShrThreads) {
    int64_t st, ln;
    span(e, &st, &ln);
    local_max = max(local_max, int((ln + kTileRows - 1) / kTileRows));
  }
  local_max = __reduce_max_sync(0xffffffffu, local_max);
  if (tid == 0) s_misc[6] = 0;
  __syncthreads();
  if (lane == 0) atomicMax(&s_misc[6], local_max);
  __syncthreads();
  const int max_tiles = s_misc[6];
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  const uint16_t* a_pool = static_cast<const uint16_t*>(a.a_pool);
  uint16_t* xa_out = static_cast<uint16_t*>(a.xa);
  const int nch = int((K + kShrKc - 1) / kShrKc);
  const int64_t total_v = int64_t(E) * max_tiles;
  for (int64_t v = blockIdx.x; v < total_v; v += gridDim.x) {
    const int i = int(v / E), e = int(v % E);
    int64_t st, ln;
    span(e, &st, &ln);
    const int64_t r0 = st + int64_t(i) * kTileRows;
    if (r0 >= st + ln) continue;  // uniform over the CTA
    const int cnt = int(min(int64_t(kTileRows), st + ln - r0));
    // 1. the rows' pairs, ranked by table row
    if (tid < kTileRows) {
      int key = INT_MAX, aslot = 0, xrow = 0;
      if (tid < cnt) {
        int64_t tk, ad;
        Pair pair;
        if (grouped_row_adapter(a.sorted_token_ids, a.row_adapter, a.has_row_adapter,
                                a.num_tokens, a.x_gather, r0 + tid, &tk, &ad) &&
            resolve_pair(a.route, ad, e, &pair)) {
          key = int(a.route.num_loras == 1 ? 0 : ad);
          aslot = pair.a;
          xrow = int(a.x_gather ? tk : r0 + tid);
        }
      }
      s_key[tid] = key;
      s_aslot[tid] = aslot;
      s_xrow[tid] = xrow;
    }
    __syncthreads();
    rank_tile_rows(s_key, s_part, s_slot, s_row, s_seg, s_misc);
    const int n_fold = s_misc[0], n_seg = s_misc[1];
    // 2. the passes
    for (int u0 = 0; u0 < n_seg * slabs;) {
      int u1, npairs;
      plan_pass(s_seg, n_seg, slabs, u0, &u1, &npairs);
      const int slo = s_seg[u0 / slabs] & ~7, shi = s_seg[(u1 - 1) / slabs + 1];
      const int nx = shi - slo, na = (u1 - u0) * 16;
      auto issue = [&](int c) {
        if (c < nch) {
          char* stg = smem + (c % kShrStages) * kShrStageBytes;
          const int64_t kb = int64_t(c) * kShrKc;
          constexpr int kPieces = kShrKc / 8;
          for (int pi = tid; pi < (na + nx) * kPieces; pi += kShrThreads) {
            const int ri = pi / kPieces, seg = pi % kPieces;
            const int64_t k = kb + 8 * seg;
            const uint16_t* src = x;
            bool valid = k < K;
            char* dst;
            if (ri < na) {  // A row of unit u0 + ri / 16
              const int u = u0 + ri / 16, j = (u % slabs) * 16 + ri % 16;
              valid = valid && j < R;
              if (valid) src = a_pool + (int64_t(s_aslot[s_row[s_seg[u / slabs]]]) * R + j) * K + k;
              dst = stg + ri * kShrAStride;
            } else {  // x row of slot slo + (ri - na)
              const int s = slo + ri - na;
              valid = valid && s < n_fold;
              if (valid) src = x + int64_t(s_xrow[s_row[s]]) * K + k;
              dst = stg + kShrXOffset + (ri - na) * kShrXStride;
            }
            cp_async16(dst + 16 * seg, src, valid);
          }
        }
        cp_async_commit();
      };
      // this warp's pairs [p0, p0 + np): A row (unit) and x row (group) in a stage
      const int ppw = (npairs + kShrWarps - 1) / kShrWarps;
      const int p0 = w * ppw, np = max(0, min(ppw, npairs - p0));
      int pa[kShrPairsPerWarp], px[kShrPairsPerWarp];
#pragma unroll
      for (int k = 0; k < kShrPairsPerWarp; ++k) {
        int unit = u0, group = slo / 8;
        if (k < np) pass_pair(s_seg, slabs, u0, u1, p0 + k, &unit, &group);
        pa[k] = (unit - u0) * 16;
        px[k] = group * 8 - slo;
      }
      float acc[kShrPairsPerWarp][4];
#pragma unroll
      for (int k = 0; k < kShrPairsPerWarp; ++k)
#pragma unroll
        for (int m = 0; m < 4; ++m) acc[k][m] = 0.f;
#pragma unroll
      for (int c = 0; c < kShrStages - 1; ++c) issue(c);
      for (int c = 0; c < nch; ++c) {
        cp_async_wait<kShrStages - 2>();  // chunk c has landed (this thread's pieces)
        __syncthreads();                  // everyone's pieces; chunk c - 1 is consumed
        issue(c + kShrStages - 1);        // into the stage chunk c - 1 used
        const char* stg = smem + (c % kShrStages) * kShrStageBytes;
#pragma unroll
        for (int kb = 0; kb < kShrKc; kb += 32) {
          const int ko = (kb + 8 * t) * 2;
          uint4 a0 = make_uint4(0u, 0u, 0u, 0u), a1 = a0;
#pragma unroll
          for (int k = 0; k < kShrPairsPerWarp; ++k) {
            if (k >= np) continue;
            // mma row g holds rank 2g, row g + 8 rank 2g + 1; lane t's 8 k
            // values are kb + 8t .. kb + 8t + 7, the same for A and x
            if (k == 0 || pa[k] != pa[k - 1]) {
              a0 = *reinterpret_cast<const uint4*>(stg + (pa[k] + 2 * g) * kShrAStride + ko);
              a1 = *reinterpret_cast<const uint4*>(stg + (pa[k] + 2 * g + 1) * kShrAStride + ko);
            }
            const uint4 xf = *reinterpret_cast<const uint4*>(stg + kShrXOffset +
                                                             (px[k] + g) * kShrXStride + ko);
            Mma<D>::run(acc[k], a0.x, a1.x, a0.y, a1.y, xf.x, xf.y);
            Mma<D>::run(acc[k], a0.z, a1.z, a0.w, a1.w, xf.z, xf.w);
          }
        }
      }
      cp_async_wait<0>();
      // C fragment: c0 (rank 2g, slot 2t), c1 (2g, 2t + 1), c2 (2g + 1, 2t), c3 (2g + 1, 2t + 1)
#pragma unroll
      for (int k = 0; k < kShrPairsPerWarp; ++k) {
        if (k >= np) continue;
        int unit, group;
        pass_pair(s_seg, slabs, u0, u1, p0 + k, &unit, &group);
        const int sg = unit / slabs, j0 = (unit % slabs) * 16;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int s = group * 8 + 2 * t + (m & 1), j = j0 + 2 * g + (m >> 1);
          if (s >= s_seg[sg] && s < s_seg[sg + 1]) s_xa[s * lay.xs + j] = f2h<D>(acc[k][m]);
        }
      }
      __syncthreads();  // the stages are refilled by the next pass
      u0 = u1;
    }
    // 3. the folding rows' xa
    const int vecs = R / 8;  // R % 8 == 0
    for (int pi = tid; pi < n_fold * vecs; pi += kShrThreads) {
      const int s = pi / vecs, vv = pi % vecs;
      *reinterpret_cast<uint4*>(xa_out + (r0 + s_row[s]) * R + 8 * vv) =
          *reinterpret_cast<const uint4*>(s_xa + s * lay.xs + 8 * vv);
    }
    __syncthreads();  // the metadata and xa are rewritten by the next tile
  }
}

template <DType D>
cudaError_t grouped_shrink(const GroupedArgs& a, cudaStream_t stream) {
  GroupedParams prm = {};
  prm.a = a;
  const int64_t lo = std::max<int64_t>(0, a.row_offset), hi = std::min<int64_t>(a.row_end, a.te);
  prm.e_eff = int(std::min<int64_t>(a.route.n_experts, a.num_experts));
  const ShrinkLayout lay(int((a.R + 15) / 16 * 16));
  const int64_t tiles = (hi - lo + kTileRows - 1) / kTileRows + prm.e_eff;
  auto kernel = grouped_shrink_kernel<D>;
  if (const cudaError_t err = ensure_smem(reinterpret_cast<const void*>(kernel), lay.total);
      err != cudaSuccess)
    return err;
  int per_sm = 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kShrThreads, lay.total) !=
          cudaSuccess ||
      per_sm < 1)
    per_sm = 1;
  const int64_t ctas = std::min<int64_t>(tiles, int64_t(sm_count()) * per_sm);
  kernel<<<unsigned(ctas), kShrThreads, lay.total, stream>>>(prm);
  return cudaPeekAtLastError();
}

}  // namespace

// The caller checks grouped_split_fits and that the window [max(0,
// row_offset), min(row_end, te)) and min(route.n_experts, num_experts) are not
// empty.
cudaError_t launch_grouped_shrink(const GroupedArgs& a, cudaStream_t stream) {
  return a.dtype == DType::kBf16 ? grouped_shrink<DType::kBf16>(a, stream)
                                 : grouped_shrink<DType::kF16>(a, stream);
}

}  // namespace fast
}  // namespace moelora
