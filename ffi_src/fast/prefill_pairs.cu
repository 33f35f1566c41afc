// Prefill fold for tiles shared by several adapters at long K: the "pairs"
// kernel, one fused tensor-core pass per (tile, adapter pair).
//
// A "pass" is up to MR = 8 * NT rows that share one (adapter, expert) pair,
// i.e. one A block [R, K] and one B block [N, R] of the pools. It runs on 32
// warps: one CTA of 32 warps, or a cluster of C CTAs of 32 / C warps
// (distributed shared memory).
//   1. xa phase: K is cut into 32-wide chunks; chunk c belongs to slice
//      c % 32 and slice s is warp s of the pass. Each warp streams its chunks
//      of A and of the pass's x rows with 16-byte loads and multiplies them on
//      the tensor cores (mma.sync m16n8k16, fp32 accumulation, rank in the M
//      dimension and rows in N, so a pass of a few rows wastes nothing).
//      Groups of 4 slices are summed in order, then the 8 groups in order
//      (through distributed shared memory when C > 1), and rounded.
//   2. fold phase: the 32 warps split the pass's output columns, compute
//      delta^T = B_cols . xa^T on the tensor cores (K = R), round, and fold
//      into base_out (4-byte accesses of two adjacent columns).
// Persistent clusters of 2 CTAs of 16 warps (or one 1024-thread CTA per SM
// when two do not fit in shared memory) walk the 32-row tiles of the expert
// spans in round-major order (tile 0 of every expert, then tile 1, ...), so
// the tiles in flight read the same token range of x (L2 reuse when
// x_gather = 1); a tile that holds several adapters runs one pass per table
// row.

#include <cooperative_groups.h>

#include "fast/fast_common.cuh"

namespace moelora {
namespace fast {
namespace {

namespace cg = cooperative_groups;

// Every fold computes xa the same way, whatever the launch shape: K is cut
// into 32-wide chunks, chunk c belongs to slice c % 32 (a chain of mma over
// the slice's chunks in order, from zero); group g sums slices 4g..4g+3 in
// order; xa = round(((G0 + G1) + ...) + G7). A launch shape is C CTAs per
// cluster (C = 1: no cluster) of W warps, C * W = 32, warp w of CTA c owning
// slice c * W + w.
constexpr int kSlices = 32;
constexpr int kGroups = 8;
constexpr int kKc = 32;             // k per chunk: two m16n8k16 steps
constexpr int kMaxSmemExperts = 4096;

// --------------------------------------------------------- smem layout -----

constexpr int kSegCap = 2048;  // rows one CTA scans per gather round

// Per-CTA shared memory of the tensor-core kernels (offsets in bytes).
struct Layout {
  int mr, r16, xs;  // rows per pass, R rounded up to 16, xa row stride (elements)
  int off_orow, off_xrow, off_wbuf, off_cbuf, off_xa, off_list, off_misc, off_experts, total;
  __host__ __device__ Layout(int nt, int C, int W, int R, int experts_in_smem) {
    mr = nt * 8;
    r16 = (R + 15) / 16 * 16;
    xs = r16 + 8;
    int o = 0;
    off_orow = o; o += mr * 4;
    off_xrow = o; o += mr * 4;
    off_wbuf = o; o += W * mr * 16 * 4;
    off_cbuf = o; o += C > 1 ? 2 * (W / 4) * mr * r16 * 4 : 0;
    off_xa = o; o += (mr * xs * 2 + 15) / 16 * 16;
    off_list = o; o += kSegCap * 4;          // gather: this CTA's matches; grouped: tile rows
    off_misc = o; o += 256;                  // warp counts, count, prefix
    off_experts = o; o += experts_in_smem * 8;  // grouped: packed span per expert
    total = (o + 15) / 16 * 16;
  }
};

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Part `part` of `nparts` of [base, base + bytes), one 128-byte line per step.
__device__ __forceinline__ void prefetch_range(const void* base, int64_t bytes, int part,
                                               int nparts) {
  const char* b = static_cast<const char*>(base);
  const int64_t lo = (bytes * part / nparts) & ~int64_t(127), hi = bytes * (part + 1) / nparts;
  for (int64_t off = lo + int64_t(threadIdx.x) * 128; off < hi; off += int64_t(blockDim.x) * 128)
    prefetch_l2(b + off);
}

// -------------------------------------------------------- one pass ---------

struct PassArgs {
  const uint16_t* x;   // [*, K]
  const uint16_t* A;   // [R, K] of the pair
  const uint16_t* B;   // [N, R] of the pair
  uint16_t* out;       // [*, N]
  int64_t K, N;
  int R;
  float scale;
  bool kvec, nvec;
  int64_t col_lo, col_hi;  // the cluster's output columns
};

// Output columns [lo, hi) of CTA `crank` within the cluster's columns.
__device__ __forceinline__ void cta_cols(const PassArgs& p, int C, int crank, int64_t* lo,
                                         int64_t* hi, int* mt0, int* mt1) {
  const int nmt = int((p.col_hi - p.col_lo + 15) / 16);
  *mt0 = crank * nmt / C;
  *mt1 = (crank + 1) * nmt / C;
  *lo = p.col_lo + int64_t(*mt0) * 16;
  *hi = min(p.col_hi, p.col_lo + int64_t(*mt1) * 16);
}

// Fold the rows listed in smem (orow/xrow, nrows <= mr) with one pair. Called
// by every thread of every CTA of the cluster with identical arguments.
// `parity` alternates the cluster-partial buffer between passes, so one
// cluster barrier per pass suffices (C > 1).
template <DType D, int NT, int C, int W>
__device__ void fold_pass(char* smem, const Layout& lay, int parity, int nrows, const PassArgs& p,
                          int crank) {
  static_assert(C * W == kSlices && W % 4 == 0, "launch shape");
  constexpr int MR = NT * 8, NTH = W * 32;
  constexpr int U = W >= 16 ? 1 : (NT == 1 ? 4 : (NT == 4 ? 2 : 1));
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int s = crank * W + w;
  const int* s_orow = reinterpret_cast<const int*>(smem + lay.off_orow);
  const int* s_xrow = reinterpret_cast<const int*>(smem + lay.off_xrow);
  float* wbuf = reinterpret_cast<float*>(smem + lay.off_wbuf);
  float* cbuf = reinterpret_cast<float*>(smem + lay.off_cbuf) + parity * (W / 4) * MR * lay.r16;
  uint16_t* xa = reinterpret_cast<uint16_t*>(smem + lay.off_xa);
  const int r16 = lay.r16, xs = lay.xs;

  // ---- xa phase: this warp's slice of K, every 16-rank slab of R ----
  const int64_t nchunks = (p.K + kKc - 1) / kKc;
  for (int j0 = 0; j0 < p.R; j0 += 16) {
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
    const int ja = j0 + 2 * g;
    const bool jv = ja < p.R;  // R % 8 == 0: ja < R implies ja + 1 < R
    const uint16_t* Aa = p.A + int64_t(jv ? ja : 0) * p.K;
    const uint16_t* Ab = Aa + (jv ? p.K : 0);
    // (unrolling spills at the 64-register cap of 32-warp CTAs; the 4-warp
    // cluster CTAs keep the compiler's default, as in v1 of docs/perf.md)
#pragma unroll (W >= 16 ? 1 : 4)
    for (int64_t c = s; c < nchunks; c += kSlices) {
      const int64_t k = c * kKc + 8 * t;
      const uint4 a0 = load8(Aa, k, p.K, p.kvec, jv);
      const uint4 a1 = load8(Ab, k, p.K, p.kvec, jv);
      uint4 xf[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int q = nt * 8 + g;
        xf[nt] = q < nrows ? load8(p.x + int64_t(s_xrow[q]) * p.K, k, p.K, p.kvec, true)
                           : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (nt * 8 < nrows) {
          Mma<D>::run(acc[nt], a0.x, a1.x, a0.y, a1.y, xf[nt].x, xf[nt].y);
          Mma<D>::run(acc[nt], a0.z, a1.z, a0.w, a1.w, xf[nt].z, xf[nt].w);
        }
      }
    }
    // C fragment: c0 (rank 2g, row 2t), c1 (2g, 2t+1), c2 (2g+1, 2t), c3 (2g+1, 2t+1)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt * 8 < nrows) {
        float* wb = wbuf + (w * MR + nt * 8 + 2 * t) * 16 + 2 * g;
        wb[0] = acc[nt][0];
        wb[1] = acc[nt][2];
        wb[16] = acc[nt][1];
        wb[17] = acc[nt][3];
      }
    }
    __syncthreads();
    if constexpr (C == 1) {
      // all 32 slices are here: groups, then the group sum, rounded
      for (int e = tid; e < MR * 16; e += NTH) {
        const int q = e >> 4, jj = e & 15;
        float v = 0.f;
        if (q < nrows) {
#pragma unroll
          for (int gi = 0; gi < kGroups; ++gi) {
            const float* wb = wbuf + (4 * gi * MR + q) * 16 + jj;
            float gsum = wb[0];
            gsum += wb[MR * 16];
            gsum += wb[2 * MR * 16];
            gsum += wb[3 * MR * 16];
            v = gi == 0 ? gsum : v + gsum;
          }
        }
        if (j0 + jj < r16) xa[q * xs + j0 + jj] = f2h<D>(v);
      }
    } else {
      for (int e = tid; e < nrows * 16; e += NTH) {
        const int q = e >> 4, jj = e & 15;
#pragma unroll
        for (int lg = 0; lg < W / 4; ++lg) {
          const float* wb = wbuf + (4 * lg * MR + q) * 16 + jj;
          float gsum = wb[0];
          gsum += wb[MR * 16];
          gsum += wb[2 * MR * 16];
          gsum += wb[3 * MR * 16];
          cbuf[(lg * MR + q) * r16 + j0 + jj] = gsum;
        }
      }
    }
    __syncthreads();
  }
  if constexpr (C > 1) {
    // ---- cluster reduction: groups in order (CTA rank, local group) ----
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    const float* rem[C];
#pragma unroll
    for (int c = 0; c < C; ++c) rem[c] = cluster.map_shared_rank(cbuf, c);
    for (int e = tid; e < MR * r16; e += NTH) {
      const int q = e / r16, j = e - q * r16;
      float v = 0.f;
      if (q < nrows && j < p.R) {
#pragma unroll
        for (int c = 0; c < C; ++c)
#pragma unroll
          for (int lg = 0; lg < W / 4; ++lg) {
            const float gsum = rem[c][(lg * MR + q) * r16 + j];
            v = (c == 0 && lg == 0) ? gsum : v + gsum;
          }
      }
      xa[q * xs + j] = f2h<D>(v);
    }
    __syncthreads();
  }

  // ---- fold phase: this CTA's 16-column tiles of [col_lo, col_hi) ----
  int64_t clo, chi;
  int mt0, mt1;
  cta_cols(p, C, crank, &clo, &chi, &mt0, &mt1);
  const int nks = r16 / 16;
  for (int base = mt0 + w; base < mt1; base += W * U) {
    float acc[U][NT][4];
    uint32_t ob[U][NT][2];
    int64_t col[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      col[u] = p.col_lo + int64_t(base + W * u) * 16 + 2 * g;
      const bool uv = base + W * u < mt1;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[u][nt][i] = 0.f;
        ob[u][nt][0] = ob[u][nt][1] = 0u;
        if (!uv || nt * 8 >= nrows) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int q = nt * 8 + 2 * t + h;
          if (q >= nrows) continue;
          const uint16_t* o = p.out + int64_t(s_orow[q]) * p.N + col[u];
          if (p.nvec && col[u] + 1 < p.col_hi) {
            ob[u][nt][h] = *reinterpret_cast<const uint32_t*>(o);
          } else {
            const uint32_t lo = col[u] < p.col_hi ? uint32_t(o[0]) : 0u;
            const uint32_t hi = col[u] + 1 < p.col_hi ? uint32_t(o[1]) : 0u;
            ob[u][nt][h] = lo | (hi << 16);
          }
        }
      }
    }
    for (int ks = 0; ks < nks; ++ks) {
      const int j = ks * 16 + 4 * t;
      const bool jv = j < p.R;  // R % 8 == 0: 4 valid or none
      uint2 b0[U], b1[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        b0[u] = b1[u] = make_uint2(0u, 0u);
        if (!jv || base + W * u >= mt1) continue;
        if (col[u] < p.col_hi)
          b0[u] = __ldg(reinterpret_cast<const uint2*>(p.B + col[u] * p.R + j));
        if (col[u] + 1 < p.col_hi)
          b1[u] = __ldg(reinterpret_cast<const uint2*>(p.B + (col[u] + 1) * p.R + j));
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (nt * 8 >= nrows) continue;
        const uint2 xf = *reinterpret_cast<const uint2*>(xa + (nt * 8 + g) * xs + ks * 16 + 4 * t);
#pragma unroll
        for (int u = 0; u < U; ++u)
          Mma<D>::run(acc[u][nt], b0[u].x, b1[u].x, b0[u].y, b1[u].y, xf.x, xf.y);
      }
    }
    // c0 (col, row 2t), c1 (col, row 2t+1), c2 (col+1, row 2t), c3 (col+1, row 2t+1)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + W * u >= mt1) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (nt * 8 >= nrows) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int q = nt * 8 + 2 * t + h;
          if (q >= nrows) continue;
          const float d0 = h2f<D>(f2h<D>(acc[u][nt][h]));
          const float d1 = h2f<D>(f2h<D>(acc[u][nt][2 + h]));
          const uint32_t o = ob[u][nt][h];
          const uint32_t n0 = f2h<D>(fold_add(h2f<D>(uint16_t(o & 0xffffu)), p.scale, d0));
          const uint32_t n1 = f2h<D>(fold_add(h2f<D>(uint16_t(o >> 16)), p.scale, d1));
          uint16_t* dst = p.out + int64_t(s_orow[q]) * p.N + col[u];
          if (p.nvec && col[u] + 1 < p.col_hi) {
            *reinterpret_cast<uint32_t*>(dst) = n0 | (n1 << 16);
          } else {
            if (col[u] < p.col_hi) dst[0] = uint16_t(n0);
            if (col[u] + 1 < p.col_hi) dst[1] = uint16_t(n1);
          }
        }
      }
    }
  }
  __syncthreads();  // orow/xrow/xa are rewritten by the next pass
}

// Persistent clusters of C CTAs of W = 32 / C warps over the MR-row tiles of
// the expert spans, in round-major order (C = 2: two tiles in flight per SM).
template <DType D, int NT, int C>
__global__ void __launch_bounds__(1024 / C, C) grouped_fast_kernel(const GroupedParams prm) {
  constexpr int W = kSlices / C, MR = NT * 8;
  static_assert(MR <= 64, "tile rows");
  extern __shared__ __align__(16) char smem[];
  const GroupedArgs& a = prm.a;
  // every CTA of a cluster reads the same offsets: they return together
  if (!cta_offsets_well_formed(a.expert_offsets, a.num_experts, a.te)) return;
  const Layout lay(NT, C, W, int(a.R), prm.smem_experts);
  const int tid = threadIdx.x, lane = tid & 31;
  int crank = 0;
  if constexpr (C > 1) crank = int(cg::this_cluster().block_rank());
  const int64_t cid = blockIdx.x / C;
  const int64_t lo = max(int64_t(0), a.row_offset), hi = min(a.row_end, a.te);
  const int E = prm.e_eff;
  int64_t* s_span = reinterpret_cast<int64_t*>(smem + lay.off_experts);
  int* s_misc = reinterpret_cast<int*>(smem + lay.off_misc);
  int* s_orow = reinterpret_cast<int*>(smem + lay.off_orow);
  int* s_xrow = reinterpret_cast<int*>(smem + lay.off_xrow);
  int* s_l = reinterpret_cast<int*>(smem + lay.off_list);  // [64] table row or -1
  int* s_tok = s_l + 64;

  auto span = [&](int e, int64_t* start, int64_t* len) {
    int64_t s0 = a.expert_offsets[e], s1 = a.expert_offsets[e + 1];
    s0 = min(max(s0, lo), hi);
    s1 = min(max(s1, s0), hi);
    *start = s0;
    *len = s1 - s0;
  };
  // spans, packed (start << 24 | len) in shared memory (host: te < 2^24)
  int local_max = 0;
  for (int e = tid; e < E; e += W * 32) {
    int64_t st, ln;
    span(e, &st, &ln);
    local_max = max(local_max, int((ln + MR - 1) / MR));
    if (prm.smem_experts) s_span[e] = (st << 24) | ln;
  }
  local_max = __reduce_max_sync(0xffffffffu, local_max);
  if (lane == 0) s_misc[tid >> 5] = local_max;
  __syncthreads();
  int max_tiles = 0;
  for (int i = 0; i < W; ++i) max_tiles = max(max_tiles, s_misc[i]);
  __syncthreads();
  int parity = 0;

  const RouteView& rt = a.route;
  const bool need_tok = a.x_gather || a.has_row_adapter;
  PassArgs p;
  p.x = static_cast<const uint16_t*>(a.x);
  p.out = static_cast<uint16_t*>(a.out);
  p.K = a.K;
  p.N = a.N;
  p.R = int(a.R);
  p.kvec = prm.kvec;
  p.nvec = prm.nvec;
  p.col_lo = 0;
  p.col_hi = a.N;
  const int64_t total_v = int64_t(E) * max_tiles;
  for (int64_t v = cid; v < total_v; v += prm.n_clusters) {
    const int i = int(v / E), e = int(v % E);
    int64_t st, ln;
    if (prm.smem_experts) {
      const int64_t pk = s_span[e];
      st = pk >> 24;
      ln = pk & ((int64_t(1) << 24) - 1);
    } else {
      span(e, &st, &ln);
    }
    const int64_t r0 = st + int64_t(i) * MR;
    if (r0 >= st + ln) continue;
    const int cnt = int(min(int64_t(MR), st + ln - r0));
    // the tile's output rows start for L2 now; per-row table row and token
    prefetch_range(p.out + r0 * a.N, int64_t(cnt) * a.N * 2, crank, C);
    if (tid < 64) {
      int lv = -1, tok = 0;
      if (tid < cnt) {
        const int64_t r = r0 + tid;
        int64_t tk, ad;
        if (grouped_row_adapter(a.sorted_token_ids, a.row_adapter, a.has_row_adapter,
                                a.num_tokens, a.x_gather, r, &tk, &ad)) {
          const int64_t ll = rt.num_loras == 1 ? 0 : ad;
          if (ad >= 0 && ll < rt.num_loras) lv = int(ll);
          tok = need_tok ? int(tk) : 0;
        }
      }
      s_l[tid] = lv;
      s_tok[tid] = tok;
    }
    __syncthreads();
    const int v0 = s_l[lane], v1 = s_l[lane + 32];
    int prev = -1;
    for (;;) {
      // next table row present in the tile (every warp computes the same)
      const int c0 = v0 > prev ? v0 : INT_MAX, c1 = v1 > prev ? v1 : INT_MAX;
      const int cur = __reduce_min_sync(0xffffffffu, min(c0, c1));
      if (cur == INT_MAX) break;
      prev = cur;
      Pair pair;
      if (!resolve_pair(rt, cur, e, &pair)) continue;
      const unsigned b0 = __ballot_sync(0xffffffffu, v0 == cur);
      const unsigned b1 = __ballot_sync(0xffffffffu, v1 == cur);
      const int nrows = __popc(b0) + __popc(b1);
      if (tid < 64) {
        const bool mine = tid < 32 ? ((b0 >> tid) & 1u) : ((b1 >> (tid - 32)) & 1u);
        if (mine) {
          const int pos = tid < 32 ? __popc(b0 & ((1u << tid) - 1u))
                                   : __popc(b0) + __popc(b1 & ((1u << (tid - 32)) - 1u));
          const int64_t r = r0 + tid;
          s_orow[pos] = int(r);
          s_xrow[pos] = a.x_gather ? s_tok[tid] : int(r);
        }
      }
      __syncthreads();
      p.A = static_cast<const uint16_t*>(a.a_pool) + int64_t(pair.a) * a.R * a.K;
      p.B = static_cast<const uint16_t*>(a.b_pool) + int64_t(pair.b) * a.N * a.R;
      p.scale = pair.scale;
      fold_pass<D, NT, C, W>(smem, lay, parity, nrows, p, crank);
      parity ^= 1;
    }
    __syncthreads();  // s_l / s_tok rewritten by the next tile
  }
  if constexpr (C > 1) cg::this_cluster().sync();  // no CTA leaves while another reads it
}

template <DType D>
cudaError_t grouped_pairs(const GroupedArgs& a, cudaStream_t stream) {
  constexpr int NT = 4, MR = NT * 8;
  GroupedParams prm;
  prm.a = a;
  const int64_t lo = std::max<int64_t>(0, a.row_offset), hi = std::min<int64_t>(a.row_end, a.te);
  if (hi <= lo) return cudaSuccess;
  prm.e_eff = int(std::min<int64_t>(a.route.n_experts, a.num_experts));
  if (prm.e_eff <= 0) return cudaSuccess;
  // packed (start << 24 | len) spans need te < 2^24
  prm.smem_experts = (prm.e_eff <= kMaxSmemExperts && a.te < (int64_t(1) << 24)) ? prm.e_eff : 0;
  prm.kvec = a.K % 8 == 0 && aligned16(a.x) && aligned16(a.a_pool);
  prm.nvec = a.N % 2 == 0 && aligned4(a.out);
  const int64_t tiles = (hi - lo + MR - 1) / MR + prm.e_eff;
  // Clusters of 2 CTAs of 16 warps, two CTAs per SM (two tiles in flight per
  // SM) when their shared memory allows; else one 1024-thread CTA per SM.
  const int smem2 = Layout(NT, 2, 16, int(a.R), prm.smem_experts).total;
  if (2 * smem2 <= 220 * 1024) {
    prm.n_clusters = std::min<int64_t>(tiles, sm_count());  // 2 CTAs per SM
    return launch(grouped_fast_kernel<D, NT, 2>, prm, prm.n_clusters * 2, 2, 512, smem2, stream);
  }
  prm.n_clusters = std::min<int64_t>(tiles, sm_count());  // one 1024-thread CTA per SM
  const int smem = Layout(NT, 1, 32, int(a.R), prm.smem_experts).total;
  return launch(grouped_fast_kernel<D, NT, 1>, prm, prm.n_clusters, 1, 1024, smem, stream);
}


}  // namespace

cudaError_t launch_grouped_pairs(const GroupedArgs& a, cudaStream_t stream) {
  switch (a.dtype) {
    case DType::kBf16: return grouped_pairs<DType::kBf16>(a, stream);
    case DType::kF16: return grouped_pairs<DType::kF16>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fast
}  // namespace moelora
