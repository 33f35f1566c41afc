// Decode fold (unsorted flat rows, bf16 / f16): the decode cells kernel, and
// launch_gather_fast, which picks the kernel for a gather fold:
//   - fp32: rows_f32.cu;
//   - decode_rows.cu, where each row reads its own A and B blocks (through
//     L2), when those reads stay small: within kRowsL2Budget bytes (Qwen3
//     T <= 64 with one adapter), or within kRowsL2Cap bytes when the cells
//     hold about one row each (rows / min(rows, L * E_t) < 2: Qwen3 and
//     DeepSeek T <= 64 with 4 adapters at rank 16). There grouping rows buys
//     nothing and the cells kernels' grouping costs;
//   - otherwise the cells kernels below, which read each A and B block once
//     per batch of up to 16 rows (T = 256, Mixtral, ranks 32 and 64 at
//     T = 64).
//
// A cell is one (table row, expert) pair: one A block [R, K] and one B block
// [N, R]. A batch is up to kBatchRows rows of one cell. The rows are grouped
// by cell in one of two ways:
//   1a. up to kScanMaxRows rows, at least one a cell on average (T = 256,
//      Mixtral from T = 64, ranks 32 and 64 at T = 64; cells_scan_slices),
//      one launch: the self-planned batch kernel runs one CTA of 256 threads
//      per (cell, slice, column chunk). Each thread keys up to 16
//      consecutive rows (l * E_t + e, or -1 when the row is skipped; all
//      their loads in flight with the cell's table entries), the CTA ranks
//      its cell's rows in row order (a scan of the threads' counts, in shared
//      memory) and folds the batches slice, slice + slices, ... of them one
//      after the other (enough slices for twice a cell's mean rows). On an
//      H200 (4 adapters, rank 16) it takes 24.0 µs where 1b takes 27.9 for
//      Qwen3 gate T = 256, 29.7 against 33.1 for down, 14.6 against 19.7 for
//      DeepSeek gate, 31.9 against 53.3 for Mixtral down.
//   1b. otherwise two launches: the plan kernel (one CTA of 1024 threads)
//      keys every row, counts the rows of each cell in shared memory, scans
//      the counts and writes the batch table (cell, first row, row count;
//      count 0 past the last batch) and the rows grouped by cell into the
//      handler's xa scratch (4 ints a row: the scratch holds R >= 8
//      activation values a row; a cell's rows in no fixed order). The batch
//      kernel (programmatic dependent launch after the plan) runs one CTA per
//      (batch, column chunk) and reads its batch entry and rows (one round
//      trip after griddepcontrol.wait).
// Then, per batch:
//   2. shrink on the tensor cores: warp w multiplies the 32-wide K chunks
//      w, w + 8, ... of A and of the batch's x rows (mma m16n8k16, ranks in M,
//      rows in N), loading up to 4 chunks of 16-byte pieces straight from
//      global memory before using any; the 8 warp partials are summed in warp
//      order and rounded into xa (shared memory; with keep_xa also into the
//      kept rows, by the first column chunk's CTA).
//   3. expand on the tensor cores: delta = xa . B^T with rows in M and 8
//      output columns per n8 tile; four tiles cover 32 adjacent columns so that
//      a lane's accumulators are 8 adjacent columns of one row: base_out moves
//      in 16-byte loads and stores. delta is rounded, then folded.
// Skip rules are fold_common.h's (a skipped row gets key -1; a cell whose a or
// b slot is 0 or outside the pool folds nothing). A row's arithmetic does not
// depend on the other rows of its batch, so results do not depend on how rows
// are batched.
//
// Shapes the kernels do not take (K % 8 != 0, unaligned pools, R < 8 or
// R > 64, or a plan larger than the plan kernel's shared memory) go to the
// simple kernels; fp32
// goes to rows_f32.cu.

#include "fast/fast_common.cuh"

namespace moelora {
namespace fast {
namespace {

constexpr int kDecThreads = 256;
constexpr int kDecWarps = kDecThreads / 32;
constexpr int kBatchRows = 16;    // rows per batch: M of the expand, two n8 tiles of the shrink
constexpr int kDecMaxRank = 64;   // 4 rank tiles of 16
constexpr int kDecSmemCap = 200 * 1024;
constexpr int kScanMaxRows = 4096;  // rows the self-planned batch kernel keys (kScanSeg a thread)
constexpr int kScanSeg = kScanMaxRows / kDecThreads;
static_assert(kScanSeg <= 32, "a thread's rows are one 32-bit mask");
constexpr int kPlanThreads = 1024;
constexpr int kPlanWarps = kPlanThreads / 32;
static_assert(kPlanWarps == 32, "the plan kernel scans its warp sums with one warp");

// Rank tiles of 16 the kernel is instantiated with for rank R (<= kDecMaxRank).
__host__ __device__ constexpr int rank_tiles(int R) { return R <= 16 ? 1 : (R <= 32 ? 2 : 4); }

// Shared memory of a batch CTA (byte offsets).
struct DecodeLayout {
  int r16, xs;  // ranks of the kernel's RT rank tiles (16, 32 or 64); xa row stride
  int off_part, off_xa, off_rows, total;
  __host__ __device__ explicit DecodeLayout(int R, int rows = kBatchRows) {
    r16 = 16 * rank_tiles(R);
    xs = r16 + 8;
    int o = 0;
    off_part = o; o += kDecWarps * kBatchRows * r16 * 4;
    off_xa = o; o += (kBatchRows * xs * 2 + 15) / 16 * 16;
    off_rows = o; o += rows * 4;
    total = (o + 15) / 16 * 16;
  }
};

// The plan in the xa scratch: batch b's (cell, first, count) at 3 b, then
// the rows grouped by cell from 3 * max_batches.
struct Plan {
  int* batch;  // [max_batches][3]
  int* rows;   // [n_slots]
};
__host__ __device__ inline Plan plan_of(void* scratch, int64_t max_batches) {
  int* p = static_cast<int*>(scratch);
  return Plan{p, p + 3 * max_batches};
}

// Shared memory of the plan kernel: each row's key and its rank within its
// cell, then per cell its row count and first row, then the warp scans.
__host__ __device__ inline int64_t plan_smem(int64_t n_slots, int64_t nkeys) {
  return (2 * n_slots + 2 * nkeys + 2 * kPlanWarps + 2) * 4;
}

struct DecodeParams {
  GatherArgs a;
  int nkeys;        // L * E_t
  int max_batches;  // batch table entries (the batch kernel's grid.x after a plan)
  int slices;       // CTAs per cell of the self-planned batch kernel
  int64_t chunk_w;  // output columns per CTA, a multiple of 32
  bool nvec;        // N % 8 == 0 and out 16-byte aligned: 16-byte output accesses
};

// Inclusive scan of a count across a warp (lane = threadIdx.x % 32).
__device__ __forceinline__ int warp_inclusive_scan(int lane, int a) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, a, o);
    if (lane >= o) a += v;
  }
  return a;
}

// The same for two counts.
__device__ __forceinline__ void warp_inclusive_scan2(int lane, int& a, int& b) {
  a = warp_inclusive_scan(lane, a);
  b = warp_inclusive_scan(lane, b);
}

__device__ __forceinline__ uint2 ldg8(const uint16_t* p) {
  return __ldg(reinterpret_cast<const uint2*>(p));
}

// K chunks of 32 each warp loads before its first mma (registers: RT rank tiles).
template <int RT>
constexpr int shrink_unroll() { return RT == 1 ? 4 : (RT == 2 ? 2 : 1); }

// Row i's cell key l * E + e, or -1 when the row is skipped (gather_row_cell's
// rule, in 32-bit arithmetic: the callers take fewer than 2^31 rows).
__device__ __forceinline__ int row_key(const GatherArgs& a, int i, int L, int E, int top_k) {
  const int ad = a.has_row_adapter ? a.row_adapter[i / top_k] : 0;
  const int e = a.indices[i];
  const int l = L == 1 ? 0 : ad;
  return ad >= 0 && l < L && e >= 0 && e < E ? l * E + e : -1;
}

// The plan kernel (one CTA): see the top of the file. Four barriers: the
// counts zeroed; every row keyed; every row counted (its rank within its cell
// taken from the atomic count); the cells scanned.
__global__ void __launch_bounds__(kPlanThreads) gather_plan_kernel(const GatherArgs a, int nkeys,
                                                                  int max_batches) {
  extern __shared__ __align__(16) char smem[];
  // the batch kernel may start now: it waits (griddepcontrol.wait) for this grid
  asm volatile("griddepcontrol.launch_dependents;");
  const int n_slots = int(a.n_slots), E = int(a.route.n_experts), L = int(a.route.num_loras);
  const int top_k = int(a.top_k);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  int* s_key = reinterpret_cast<int*>(smem);
  int* s_pos = s_key + n_slots;
  int* s_cnt = s_pos + n_slots;
  int* s_first = s_cnt + nkeys;
  int* s_scan = s_first + nkeys;  // [2][kPlanWarps] per warp, then 2 totals
  const Plan plan = plan_of(a.xa, max_batches);

  for (int k = tid; k < nkeys; k += kPlanThreads) s_cnt[k] = 0;
  // every row's key (gather_row_cell's rule; both loads of a row in flight at once)
#pragma unroll 4
  for (int i = tid; i < n_slots; i += kPlanThreads) s_key[i] = row_key(a, i, L, E, top_k);
  __syncthreads();
  for (int i = tid; i < n_slots; i += kPlanThreads) {
    const int key = s_key[i];
    s_pos[i] = key >= 0 ? atomicAdd(&s_cnt[key], 1) : 0;
  }
  __syncthreads();
  // rows and batches of each thread's contiguous key segment, scanned
  const int seg = (nkeys + kPlanThreads - 1) / kPlanThreads;
  const int k0 = min(nkeys, tid * seg), k1 = min(nkeys, k0 + seg);
  int rows = 0, batches = 0;
  for (int k = k0; k < k1; ++k) {
    rows += s_cnt[k];
    batches += (s_cnt[k] + kBatchRows - 1) / kBatchRows;
  }
  int ri = rows, bi = batches;
  warp_inclusive_scan2(lane, ri, bi);
  if (lane == 31) {
    s_scan[w] = ri;
    s_scan[kPlanWarps + w] = bi;
  }
  __syncthreads();
  if (w == 0) {  // the warps' sums scanned by warp 0 (kPlanWarps == 32), exclusive
    int rw = s_scan[lane], bw = s_scan[kPlanWarps + lane];
    const int r_own = rw, b_own = bw;
    warp_inclusive_scan2(lane, rw, bw);
    s_scan[lane] = rw - r_own;
    s_scan[kPlanWarps + lane] = bw - b_own;
    if (lane == 31) s_scan[2 * kPlanWarps + 1] = bw;  // batches in all
  }
  __syncthreads();
  int row0 = s_scan[w] + ri - rows, batch0 = s_scan[kPlanWarps + w] + bi - batches;
  const int total = s_scan[2 * kPlanWarps + 1];
  for (int k = k0; k < k1; ++k) {
    const int c = s_cnt[k];
    s_first[k] = row0;
    for (int j = 0; j * kBatchRows < c; ++j, ++batch0) {
      plan.batch[3 * batch0] = k;
      plan.batch[3 * batch0 + 1] = row0 + j * kBatchRows;
      plan.batch[3 * batch0 + 2] = min(kBatchRows, c - j * kBatchRows);
    }
    row0 += c;
  }
  for (int b = total + tid; b < max_batches; b += kPlanThreads) plan.batch[3 * b + 2] = 0;
  __syncthreads();
  for (int i = tid; i < n_slots; i += kPlanThreads)
    if (s_key[i] >= 0) plan.rows[s_first[s_key[i]] + s_pos[i]] = i;
}

// One batch of up to kBatchRows rows of one cell (the rows' indices in
// shared memory), on the CTA's column chunk: steps 2 and 3 of the top of the
// file.
template <DType D, int RT>
__device__ __forceinline__ void fold_batch(const DecodeParams& p, char* smem, const int* rows,
                                           int cnt, int expert, int32_t pa, int32_t pb,
                                           float scale) {
  constexpr int kShrinkUnroll = shrink_unroll<RT>();
  constexpr int UG = RT == 1 ? 4 : (RT == 2 ? 2 : 1);  // 32-column groups a warp loads at once
  const GatherArgs& a = p.a;
  const DecodeLayout lay(int(a.R));
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  float* s_part = reinterpret_cast<float*>(smem + lay.off_part);
  uint16_t* s_xa = reinterpret_cast<uint16_t*>(smem + lay.off_xa);
  const int R = int(a.R);
  const int64_t K = a.K, N = a.N;

  // The expand's operands of the 32-column groups gi0 + u * kDecWarps (step
  // 3): lane (g, t) holds the B fragments of its n8 tiles and the base_out
  // pieces (columns 8t .. 8t+7 of rows g and g + 8).
  const uint16_t* B = static_cast<const uint16_t*>(a.b_pool) + int64_t(pb) * N * R;
  const int64_t c0 = int64_t(blockIdx.y) * p.chunk_w, c1 = min(N, c0 + p.chunk_w);
  const int ngroups = int((c1 - c0 + 31) / 32);
  uint16_t* orow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
    orow[h] = g + 8 * h < cnt ? a.out_row<uint16_t>(rows[g + 8 * h], expert) : nullptr;
  uint2 bv[UG][4][RT];
  uint4 ov[UG][2];
  const auto load_groups = [&](int gi0) {
    const uint2 zero2 = make_uint2(0u, 0u);
#pragma unroll
    for (int u = 0; u < UG; ++u) {
      const int64_t gc = c0 + int64_t(gi0 + u * kDecWarps) * 32;
      const bool gin = gi0 + u * kDecWarps < ngroups;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t col = gc + 8 * (g >> 1) + 2 * i + (g & 1);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
          bv[u][i][rt] = gin && col < c1 && rt * 16 + 4 * t < R ? ldg8(B + col * R + rt * 16 + 4 * t) : zero2;
      }
      const int64_t oc = gc + 8 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ov[u][h] = make_uint4(0u, 0u, 0u, 0u);
        if (!gin || orow[h] == nullptr || oc >= c1) continue;
        if (p.nvec && oc + 8 <= c1) {
          ov[u][h] = *reinterpret_cast<const uint4*>(orow[h] + oc);
        } else {
          uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (oc + j < c1) tmp[j] = orow[h][oc + j];
          memcpy(&ov[u][h], tmp, 16);
        }
      }
    }
  };

  // 2. shrink: acc[rt][nt] = A[16 rt .. 16 rt + 16) . x[rows 8 nt .. 8 nt + 8)^T
  const uint16_t* A = static_cast<const uint16_t*>(a.a_pool) + int64_t(pa) * R * K;
  const int nt_rows = cnt > 8 ? 2 : 1;
  const uint16_t* xr[2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int q = nt * 8 + g;
    const int64_t row = q < cnt ? rows[q] : 0;
    xr[nt] = q < cnt ? a.x_row<uint16_t>(row, expert) : nullptr;
  }
  float acc[RT][2][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][nt][i] = 0.f;
  const int nch = int((K + 31) / 32);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int k0 = w; k0 < nch; k0 += kDecWarps * kShrinkUnroll) {
    uint4 av[kShrinkUnroll][RT][2], xv[kShrinkUnroll][2];
#pragma unroll
    for (int u = 0; u < kShrinkUnroll; ++u) {
      const int64_t k = int64_t(k0 + u * kDecWarps) * 32 + 8 * t;
      const bool kin = k < K;
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        const int r0 = rt * 16 + g, r1 = r0 + 8;
        av[u][rt][0] = kin && r0 < R ? __ldg(reinterpret_cast<const uint4*>(A + int64_t(r0) * K + k)) : zero;
        av[u][rt][1] = kin && r1 < R ? __ldg(reinterpret_cast<const uint4*>(A + int64_t(r1) * K + k)) : zero;
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
        xv[u][nt] = kin && nt < nt_rows && xr[nt] != nullptr
                        ? __ldg(reinterpret_cast<const uint4*>(xr[nt] + k))
                        : zero;
    }
#pragma unroll
    for (int u = 0; u < kShrinkUnroll; ++u)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          if (nt >= nt_rows) continue;
          const uint4 a0 = av[u][rt][0], a1 = av[u][rt][1], xf = xv[u][nt];
          Mma<D>::run(acc[rt][nt], a0.x, a1.x, a0.y, a1.y, xf.x, xf.y);
          Mma<D>::run(acc[rt][nt], a0.z, a1.z, a0.w, a1.w, xf.z, xf.w);
        }
  }
  // C fragment: c0 (rank g, row 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)
  const int r16 = lay.r16;
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int q = nt * 8 + 2 * t + (i & 1), j = rt * 16 + g + 8 * (i >> 1);
        s_part[(w * kBatchRows + q) * r16 + j] = acc[rt][nt][i];
      }
  __syncthreads();
  // keep_xa: the batch's rows' xa also to the kept rows, by the CTAs of the
  // first column chunk
  uint16_t* kept = blockIdx.y == 0 ? static_cast<uint16_t*>(a.kept_xa) : nullptr;
  for (int e = tid; e < kBatchRows * r16; e += kDecThreads) {
    const int q = e / r16, j = e - q * r16;
    float v = 0.f;
    if (q < cnt && j < R) {
      v = s_part[q * r16 + j];
#pragma unroll
      for (int ww = 1; ww < kDecWarps; ++ww) v += s_part[(ww * kBatchRows + q) * r16 + j];
      if (kept) kept[int64_t(rows[q]) * R + j] = f2h<D>(v);
    }
    s_xa[q * lay.xs + j] = f2h<D>(v);
  }
  __syncthreads();

  // 3. expand: 32-column groups; lane (g, t) ends with columns 8t .. 8t+7 of
  // rows g and g + 8. n8 tile i's column c <-> group column 8 (c / 2) + 2 i + c % 2.
  uint2 xf[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
    xf[rt][0] = *reinterpret_cast<const uint2*>(s_xa + g * lay.xs + rt * 16 + 4 * t);
    xf[rt][1] = *reinterpret_cast<const uint2*>(s_xa + (g + 8) * lay.xs + rt * 16 + 4 * t);
  }
  for (int gi0 = w; gi0 < ngroups; gi0 += kDecWarps * UG) {
    load_groups(gi0);
#pragma unroll
    for (int u = 0; u < UG; ++u) {
      const int64_t gc = c0 + int64_t(gi0 + u * kDecWarps) * 32;
      if (gi0 + u * kDecWarps >= ngroups) continue;
      float d[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        d[i][0] = d[i][1] = d[i][2] = d[i][3] = 0.f;
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
          Mma<D>::run(d[i], xf[rt][0].x, xf[rt][1].x, xf[rt][0].y, xf[rt][1].y, bv[u][i][rt].x,
                      bv[u][i][rt].y);
      }
      const int64_t oc = gc + 8 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (orow[h] == nullptr || oc >= c1) continue;
        uint32_t o2[4];  // columns oc + 2i, oc + 2i + 1
        memcpy(o2, &ov[u][h], 16);
#pragma unroll
        for (int i = 0; i < 4; ++i) o2[i] = fold_pair<D>(o2[i], scale, d[i][2 * h], d[i][2 * h + 1]);
        if (p.nvec && oc + 8 <= c1) {
          uint4 v;
          memcpy(&v, o2, 16);
          *reinterpret_cast<uint4*>(orow[h] + oc) = v;
        } else {
          uint16_t o[8];
          memcpy(o, o2, 16);
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (oc + j < c1) orow[h][oc + j] = o[j];
        }
      }
    }
  }
}

// Whether a cell's pair folds (fold_common.h's rule).
__device__ __forceinline__ bool pair_folds(const GatherArgs& a, int32_t pa, int32_t pb) {
  return pa > 0 && pb > 0 && pa < a.route.pool_size && pb < a.route.pool_size;
}

// The batch kernel after the plan kernel (programmatic dependent launch): one
// CTA per (batch of the plan, column chunk).
template <DType D, int RT>
__global__ void __launch_bounds__(kDecThreads) gather_cells_kernel(const DecodeParams p) {
  extern __shared__ __align__(16) char smem[];
  const GatherArgs& a = p.a;
  const DecodeLayout lay(int(a.R));
  int* s_rows = reinterpret_cast<int*>(smem + lay.off_rows);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const Plan plan = plan_of(a.xa, p.max_batches);
  const int b = blockIdx.x;
  const int cnt = plan.batch[3 * b + 2];
  if (cnt == 0) return;  // uniform: past the last batch
  const int key = plan.batch[3 * b], first = plan.batch[3 * b + 1];
  if (threadIdx.x < cnt) s_rows[threadIdx.x] = plan.rows[first + threadIdx.x];
  // the cell's pair (loads in flight with the rows')
  const int32_t pa = a.route.a_table[key], pb = a.route.b_table[key];
  const float scale = a.route.scale_table[key];
  __syncthreads();
  if (!pair_folds(a, pa, pb)) return;
  fold_batch<D, RT>(p, smem, s_rows, cnt, key % int(a.route.n_experts), pa, pb, scale);
}

// The self-planned batch kernel (up to kScanMaxRows rows, no plan kernel):
// one CTA per (cell, slice, column chunk). Each thread keys up to kScanSeg
// consecutive rows (all their loads in flight with the cell's pair), the
// CTA ranks the cell's rows in row order (a scan of the threads' counts) and
// folds the batches slice, slice + slices, ... of them.
template <DType D, int RT>
__global__ void __launch_bounds__(kDecThreads, 2) gather_cells_scan_kernel(const DecodeParams p) {
  extern __shared__ __align__(16) char smem[];
  const GatherArgs& a = p.a;
  const DecodeLayout lay(int(a.R));
  int* s_rows = reinterpret_cast<int*>(smem + lay.off_rows);  // [kScanMaxRows]
  int* s_wsum = reinterpret_cast<int*>(smem + lay.off_part);  // [kDecWarps], before s_part is used
  const int key = int(blockIdx.x) / p.slices, slice = int(blockIdx.x) % p.slices;
  const int32_t pa = a.route.a_table[key], pb = a.route.b_table[key];
  const float scale = a.route.scale_table[key];
  const int n_slots = int(a.n_slots), L = int(a.route.num_loras), E = int(a.route.n_experts);
  const int top_k = int(a.top_k);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int seg = (n_slots + kDecThreads - 1) / kDecThreads, r0 = tid * seg;
  unsigned mine = 0;
#pragma unroll
  for (int j = 0; j < kScanSeg; ++j)
    if (j < seg && r0 + j < n_slots && row_key(a, r0 + j, L, E, top_k) == key) mine |= 1u << j;
  const int n = __popc(mine);
  const int incl = warp_inclusive_scan(lane, n);
  if (lane == 31) s_wsum[w] = incl;
  __syncthreads();
  int rank = incl - n, total = 0;
#pragma unroll
  for (int ww = 0; ww < kDecWarps; ++ww) {
    const int s = s_wsum[ww];
    rank += ww < w ? s : 0;
    total += s;
  }
  for (; mine != 0; mine &= mine - 1) s_rows[rank++] = r0 + __ffs(mine) - 1;
  __syncthreads();
  if (!pair_folds(a, pa, pb)) return;  // uniform
  for (int b = slice; b * kBatchRows < total; b += p.slices) {
    if (b > slice) __syncthreads();  // the previous batch is done with s_part and s_xa
    fold_batch<D, RT>(p, smem, s_rows + b * kBatchRows, min(kBatchRows, total - b * kBatchRows),
                      key % E, pa, pb, scale);
  }
}

// Output columns per CTA: enough CTAs for two per SM when the cells are
// few, in whole 32-column groups of at least 64 columns (each chunk repeats
// the shrink of its batch).
int64_t decode_chunk_w(int64_t N, int64_t batches) {
  int64_t chunks = std::max<int64_t>(1, 2 * sm_count() / std::max<int64_t>(1, batches));
  chunks = std::min<int64_t>({chunks, std::max<int64_t>(1, N / 64), 65535});
  const int64_t w = (N + chunks - 1) / chunks;
  return (w + 31) / 32 * 32;
}

// The self-planned batch kernel when p.slices > 0, else the plan kernel,
// then the batch kernel with programmatic dependent launch.
template <DType D, int RT>
cudaError_t gather_cells_rt(const DecodeParams& p, int plan_bytes, cudaStream_t stream) {
  const unsigned chunks = unsigned((p.a.N + p.chunk_w - 1) / p.chunk_w);
  if (p.slices > 0) {
    const DecodeLayout lay(int(p.a.R), kScanMaxRows);
    auto kernel = gather_cells_scan_kernel<D, RT>;
    if (const cudaError_t err = ensure_smem(reinterpret_cast<const void*>(kernel), lay.total);
        err != cudaSuccess)
      return err;
    kernel<<<dim3(unsigned(p.nkeys * p.slices), chunks, 1), kDecThreads, lay.total, stream>>>(p);
    return cudaPeekAtLastError();
  }
  if (const cudaError_t err = ensure_smem(reinterpret_cast<const void*>(gather_plan_kernel),
                                          plan_bytes);
      err != cudaSuccess)
    return err;
  gather_plan_kernel<<<1, kPlanThreads, plan_bytes, stream>>>(p.a, p.nkeys, p.max_batches);
  if (const cudaError_t err = cudaPeekAtLastError(); err != cudaSuccess) return err;
  const DecodeLayout lay(int(p.a.R));
  auto kernel = gather_cells_kernel<D, RT>;
  if (const cudaError_t err = ensure_smem(reinterpret_cast<const void*>(kernel), lay.total);
      err != cudaSuccess)
    return err;
  return launch_dependent(kernel, dim3(unsigned(p.max_batches), chunks, 1), kDecThreads, lay.total,
                          stream, p.a.pdl, p);
}

// CTAs per cell of the self-planned batch kernel (0: plan it with the plan
// kernel). It takes up to kScanMaxRows rows, at least one a cell on average
// (with fewer, most of its CTAs, one per cell, find no row: Mixtral at T = 1
// has 2 rows for 32 cells; at one row a cell, Qwen3 rank 64 at T = 64, it
// measured 46.4 against 48.4 µs for gate and 51.3 against 51.9 for down),
// while the ids all its CTAs read (4 bytes a row a CTA) stay within
// kScanMaxIds; a cell's batches are spread over enough CTAs for twice the
// mean rows of a cell.
int cells_scan_slices(int64_t n_slots, int64_t nkeys) {
  constexpr int64_t kScanMaxIds = int64_t(4) << 20;
  constexpr int64_t kMaxSlices = 8;
  const int64_t slices = std::clamp<int64_t>(
      (2 * n_slots + nkeys * kBatchRows - 1) / (nkeys * kBatchRows), 1, kMaxSlices);
  return n_slots <= kScanMaxRows && n_slots >= nkeys &&
                 nkeys * slices * n_slots <= kScanMaxIds
             ? int(slices)
             : 0;
}

// Whether the decode cells kernels take these arguments, and their launch.
bool gather_cells(const GatherArgs& a, cudaStream_t stream, cudaError_t* err) {
  // the plan takes 4 ints a row of the xa scratch ([n_slots, R], 2-byte values)
  if (a.K % 8 != 0 || a.R < 8 || a.R > kDecMaxRank || !aligned16(a.x) || !aligned16(a.a_pool) ||
      !aligned16(a.b_pool) || !aligned16(a.xa) || a.n_slots >= INT_MAX / 4)
    return false;
  const int64_t nkeys = a.route.num_loras * a.route.n_experts;
  if (nkeys <= 0 || nkeys >= INT_MAX / 8) return false;
  DecodeParams p;
  p.a = a;
  p.nkeys = int(nkeys);
  p.slices = cells_scan_slices(a.n_slots, nkeys);
  const int64_t plan_bytes = p.slices > 0 ? 0 : plan_smem(a.n_slots, nkeys);
  if (plan_bytes > kDecSmemCap) return false;
  // batches: at most one per row, at most one per key plus one per full batch
  p.max_batches = int(std::min<int64_t>(a.n_slots, nkeys + (a.n_slots + kBatchRows - 1) / kBatchRows));
  p.chunk_w = decode_chunk_w(a.N, std::min<int64_t>(a.n_slots, nkeys) * std::max(1, p.slices));
  p.nvec = a.N % 8 == 0 && outs_aligned(a, 16);
  const bool bf16 = a.dtype == DType::kBf16;
  const int pb = int(plan_bytes);
  switch (rank_tiles(int(a.R))) {
    case 1:
      *err = bf16 ? gather_cells_rt<DType::kBf16, 1>(p, pb, stream)
                  : gather_cells_rt<DType::kF16, 1>(p, pb, stream);
      break;
    case 2:
      *err = bf16 ? gather_cells_rt<DType::kBf16, 2>(p, pb, stream)
                  : gather_cells_rt<DType::kF16, 2>(p, pb, stream);
      break;
    default:
      *err = bf16 ? gather_cells_rt<DType::kBf16, 4>(p, pb, stream)
                  : gather_cells_rt<DType::kF16, 4>(p, pb, stream);
      break;
  }
  return true;
}

}  // namespace
}  // namespace fast

cudaError_t launch_gather_fast(const GatherArgs& args, cudaStream_t stream) {
  if (args.n_slots <= 0 || args.N <= 0 || args.K <= 0 || args.R <= 0) return cudaSuccess;
  if (args.dtype == DType::kF32) return fast::launch_gather_f32(args, stream);
  cudaError_t err = cudaSuccess;
  const int64_t cells = std::min<int64_t>(args.n_slots, args.route.num_loras * args.route.n_experts);
  // L2 bytes the rows kernel reads: every row its A [R, K] and B [N, R] block.
  // H200, 4 adapters, rows against cells kernels: Qwen3 gate T = 64 (46 MB,
  // about one row a cell) 10.5 against 16.0 µs, down 11.4 against 20.7,
  // DeepSeek gate 9.8 against 11.6; the decode step's gate+up stacked and
  // down folds 151 against 223 µs a step; Qwen3 gate+up stacked T = 64 at
  // rank 32 (184 MB) 55.1 against 48.7 µs (the cells grouped by the plan
  // kernel), gate T = 64 at rank 64 (184 MB) 58.9 against 46.4 µs.
  constexpr int64_t kRowsL2Budget = int64_t(48) << 20;
  constexpr int64_t kRowsL2Cap = int64_t(96) << 20;
  const int64_t row_blocks = args.n_slots * args.R * (args.K + args.N) * 2;
  if (fast::gather_rows_fits(args) && (row_blocks <= kRowsL2Budget ||
                                       (args.n_slots < 2 * cells && row_blocks <= kRowsL2Cap)))
    return fast::launch_gather_rows(args, stream);
  if (fast::gather_cells(args, stream, &err)) return err;
  return launch_gather_simple(args, stream);
}

}  // namespace moelora
