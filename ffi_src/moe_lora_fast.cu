// The tuned ("fast") MoE LoRA folds: launch_gather_fast and
// launch_grouped_fast (declared in cuda_common.cuh), called by the CUDA FFI
// handlers when variant == kVariantFast. Semantics are SPEC section 5 exactly
// (skip rules from fold_common.h, xa rounded to the activation dtype, delta
// rounded, then fold_add); only the fp32 summation order differs from the
// seed kernels.
//
// Gather (decode, bf16 / f16): one CTA of 256 threads per (row, column chunk)
// on the CUDA cores (see "decode: one CTA a row" below): a decode row is a
// matrix-vector product bound by loads. K not a multiple of 8 takes the seed
// kernels. (A tensor-core gather that ran a cell's rows as one pass was 1.5-4x
// slower on every decode case measured but one: docs/perf.md.)
//
// Grouped (prefill, bf16 / f16): the cells kernel (v4, "prefill: cells
// kernel" below): tiles of up to 64 rows, A and x streamed through a cp.async
// pipeline, tensor cores for both products. Tiles shared by several adapters
// at K >= 4096 (or MOELORA_FAST_GROUPED=tc) take the v2b kernel:
//
// v2b, one fused tensor-core kernel. A "pass" is up
// to MR = 8 * NT rows that share one (adapter, expert) pair, i.e. one A block
// [R, K] and one B block [N, R] of the pools. It runs on 32 warps: one CTA of
// 32 warps, or a cluster of C CTAs of 32 / C warps (distributed shared memory).
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
// Persistent clusters of 2 CTAs of 16 warps (or one 1024-thread CTA per SM,
// MOELORA_FAST_GROUPED_C=1) walk the 32-row tiles of the expert spans in
// round-major order (tile 0 of every expert, then tile 1, ...), so the tiles
// in flight read the same token range of x (L2 reuse when x_gather = 1); a
// tile that holds several adapters runs one pass per table row.
//
// fp32: a simple CUDA-core path (one CTA per row and column chunk), no TF32.
//
// No allocation, no host synchronisation, no device-side state: graph
// capturable (the handlers declare kCmdBufferCompatible).
#include <cooperative_groups.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>

#include "cuda_common.cuh"

namespace moelora {
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
constexpr int kF32Threads = 128;

// ---------------------------------------------------------------- mma ------

template <DType D> struct Mma;
template <> struct Mma<DType::kBf16> {
  static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};
template <> struct Mma<DType::kF16> {
  static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// ------------------------------------------------------------ loads --------

// 8 consecutive 16-bit elements row[k .. k+8), zeros past K or when !valid.
// vec: K % 8 == 0 and row 16-byte aligned (then the 8 are all in or all out).
__device__ __forceinline__ uint4 load8(const uint16_t* row, int64_t k, int64_t K, bool vec,
                                       bool valid) {
  uint4 r = make_uint4(0u, 0u, 0u, 0u);
  if (!valid || k >= K) return r;
  if (vec) return __ldg(reinterpret_cast<const uint4*>(row + k));
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = k + 2 * i < K ? uint32_t(__ldg(row + k + 2 * i)) : 0u;
    const uint32_t hi = k + 2 * i + 1 < K ? uint32_t(__ldg(row + k + 2 * i + 1)) : 0u;
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <DType D>
__device__ __forceinline__ float h2f(uint16_t h) {
  using T = typename Traits<D>::T;
  T v;
  memcpy(&v, &h, 2);
  return Traits<D>::to_f(v);
}
template <DType D>
__device__ __forceinline__ uint16_t f2h(float f) {
  using T = typename Traits<D>::T;
  T v = Traits<D>::from_f(f);
  uint16_t h;
  memcpy(&h, &v, 2);
  return h;
}

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

// ------------------------------------------------------------ gather -------

__device__ __forceinline__ bool gather_row_cell(const GatherArgs& a, int64_t row, int* l, int* e) {
  const int64_t ad = a.has_row_adapter ? int64_t(a.row_adapter[row / a.top_k]) : 0;
  if (ad < 0) return false;
  const int64_t ll = a.route.num_loras == 1 ? 0 : ad;
  if (ll >= a.route.num_loras) return false;
  const int64_t ee = a.indices[row];
  if (ee < 0 || ee >= a.route.n_experts) return false;
  *l = int(ll);
  *e = int(ee);
  return true;
}

// ----------------------------------------------------------- grouped -------

struct GroupedParams {
  GroupedArgs a;
  int64_t n_clusters;
  int e_eff;         // experts with tiles: min(table length, num_experts)
  int smem_experts;  // e_eff when their spans fit in shared memory, else 0
  bool kvec, nvec;
};

// Persistent clusters of C CTAs of W = 32 / C warps over the MR-row tiles of
// the expert spans, in round-major order (C = 2: two tiles in flight per SM).
template <DType D, int NT, int C>
__global__ void __launch_bounds__(1024 / C, C) grouped_fast_kernel(const GroupedParams prm) {
  constexpr int W = kSlices / C, MR = NT * 8;
  static_assert(MR <= 64, "tile rows");
  extern __shared__ __align__(16) char smem[];
  const GroupedArgs& a = prm.a;
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

// -------------------------------------------------------------- fp32 -------

// One CTA per (row, column chunk): xa[j] by warp j % 4 (lanes stride K, fixed
// butterfly reduction), then delta per column in rank order. The same
// device function serves both folds, so both give the same bits.
__device__ void f32_fold_row(const float* xrow, const float* A, const float* B, float scale,
                             int64_t K, int R, int64_t N, float* orow, int64_t c0, int64_t c1) {
  __shared__ float s_xa[kMaxRank];
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  for (int j = w; j < R; j += 4) {
    const float* arow = A + int64_t(j) * K;
    float acc = 0.f;
    for (int64_t k = lane; k < K; k += 32) acc = fmaf(xrow[k], arow[k], acc);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) s_xa[j] = acc;
  }
  __syncthreads();
  for (int64_t n = c0 + tid; n < c1; n += kF32Threads) {
    const float* brow = B + n * R;
    float acc = 0.f;
    for (int j = 0; j < R; ++j) acc = fmaf(s_xa[j], brow[j], acc);
    orow[n] = fold_add(orow[n], scale, acc);
  }
}

constexpr int64_t kF32Cols = 1024;

__global__ void __launch_bounds__(kF32Threads) gather_f32_kernel(const GatherArgs a) {
  const int64_t row = blockIdx.x;
  int l, e;
  if (!gather_row_cell(a, row, &l, &e)) return;
  Pair pair;
  if (!resolve_pair(a.route, l, e, &pair)) return;
  const int64_t c0 = int64_t(blockIdx.y) * kF32Cols, c1 = min(a.N, c0 + kF32Cols);
  const int64_t xrow = a.x_gather ? row / a.top_k : row;
  f32_fold_row(static_cast<const float*>(a.x) + xrow * a.K,
               static_cast<const float*>(a.a_pool) + int64_t(pair.a) * a.R * a.K,
               static_cast<const float*>(a.b_pool) + int64_t(pair.b) * a.N * a.R, pair.scale,
               a.K, int(a.R), a.N, static_cast<float*>(a.out) + row * a.N, c0, c1);
}

__global__ void __launch_bounds__(kF32Threads) grouped_f32_kernel(const GroupedArgs a, int64_t lo) {
  const int64_t r = lo + blockIdx.x;
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
  f32_fold_row(static_cast<const float*>(a.x) + xrow * a.K,
               static_cast<const float*>(a.a_pool) + int64_t(pair.a) * a.R * a.K,
               static_cast<const float*>(a.b_pool) + int64_t(pair.b) * a.N * a.R, pair.scale,
               a.K, int(a.R), a.N, static_cast<float*>(a.out) + r * a.N, c0, c1);
}

// ------------------------------------------------- decode: one CTA a row --

// A decode row is a matrix-vector product bound by loads, so the default
// gather kernel gives each (row, column chunk) its own CTA of kRowThreads:
//   1. warp w computes xa[j] for j = w, w + 8, ...: lanes stride K with
//      16-byte loads of A and x (fp32 partial sums in k order per lane, then a
//      fixed butterfly), rounded to the dtype into shared memory;
//   2. thread t folds columns c0 + t, c0 + t + kRowThreads, ... of the chunk:
//      delta = round(xa . B[n]) (16-byte loads of the B row, rank order),
//      out = round(out + scale * delta).
// No scan, no tensor cores, one barrier; A and B blocks shared by several
// rows are re-read from L2. It sums in another order than the tensor-core
// kernels (so moe_lora_fold's gather and sorted paths agree to the "any
// backend" tolerance, not to the bit, for impl "fast").
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

// ---------------------------------------- prefill: cells kernel (v4) ------
//
// A "batch" is up to MR = 8 * NRG rows of one tile that fold with one pair:
// one A block [R, K], one B block [N, R]. One CTA of kCellThreads:
//  1. shrink on the tensor cores: K streams in chunks of kCellKc through an
//     S-stage cp.async pipeline (the chunk of A for RP ranks and of the
//     batch's x rows, in shared memory, up to S chunks in flight); warp w
//     multiplies the 32-wide slice w of every chunk (mma m16n8k16, rank in M,
//     rows in N, fp32); the 8 warp partials are summed in warp order and
//     rounded into xa (shared memory, activation dtype). Ranks go in passes
//     of RP = 16 * SP, SP * NRG = 8 accumulator tiles per warp.
//  2. expand on the tensor cores: the warps split the CTA's output columns
//     in 16-column tiles, delta^T = B_cols . xa^T (K = R), rounded, folded
//     into base_out.
// Persistent CTAs walk the MR-row tiles of the expert spans in round-major
// order; a tile's rows with one table row form a batch. (The same device
// code run as one CTA per (table cell, column chunk) over the unsorted
// decode rows was 1.5-5x slower than the one-CTA-a-row gather: docs/perf.md.)

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
  int off_stage, off_xa, off_list, off_xrow, off_orow, off_misc, total;
  __host__ __device__ CellLayout(int nrg, int R, int nstages) {
    mr = 8 * nrg;
    r16 = (R + 15) / 16 * 16;
    const int sp = nrg >= 8 ? 1 : 8 / nrg;
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
    off_misc = o; o += 64 * 4;
    total = (o + 127) / 128 * 128;
  }
  static int stages_for(int nrg, int R) {
    const int s = kCellStageBudget / CellLayout(nrg, R, 1).stage;
    return s < 1 ? 1 : (s > kCellMaxStages ? kCellMaxStages : s);
  }
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
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
// memory). Every thread of the CTA calls it; it ends with a barrier.
template <DType D, int NRG>
__device__ void cell_shrink(char* smem, const CellLayout& lay, int nrows, const uint16_t* x,
                            const uint16_t* A, int64_t K, int R) {
  constexpr int SP = NRG >= 8 ? 1 : 8 / NRG;
  constexpr int kPieces = kCellKc / 8;  // 16-byte pieces per row of a chunk
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int* s_xrow = reinterpret_cast<const int*>(smem + lay.off_xrow);
  uint16_t* xa = reinterpret_cast<uint16_t*>(smem + lay.off_xa);
  char* stages = smem + lay.off_stage;
  float* wbuf = reinterpret_cast<float*>(stages);
  const int nch = int((K + kCellKc - 1) / kCellKc);
  const int nrg = (nrows + 7) / 8;
  for (int p0 = 0; p0 < lay.r16; p0 += lay.rp) {
    const int rp = min(lay.rp, lay.r16 - p0);
    const int nslab = rp / 16;
    const int npieces = (rp + nrg * 8) * kPieces;
    auto issue = [&](int c, int buf) {
      char* st = stages + buf * lay.stage;
      const int64_t kb = int64_t(c) * kCellKc;
      for (int i = tid; i < npieces; i += kCellThreads) {
        const int ri = i / kPieces, seg = i - ri * kPieces;
        const int64_t k = kb + seg * 8;
        const uint16_t* src = A;
        bool valid;
        char* dst;
        if (ri < rp) {
          const int j = p0 + ri;
          valid = j < R && k < K;
          if (valid) src = A + int64_t(j) * K + k;
          dst = st + ri * kCellAStride + seg * 16;
        } else {
          const int q = ri - rp;
          valid = q < nrows && k < K;
          if (valid) src = x + int64_t(s_xrow[q]) * K + k;
          dst = st + rp * kCellAStride + q * kCellXStride + seg * 16;
        }
        cp_async16(dst, src, valid);
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

// out[orow[q], c0:c1] = round(out + scale * round(xa[q] . B[n])) for the
// batch's rows, on the tensor cores. nvec: 4-byte output accesses allowed
// (N even, out 4-byte aligned, c0 even).
template <DType D, int NRG>
__device__ void cell_expand(char* smem, const CellLayout& lay, int nrows, const uint16_t* B,
                            uint16_t* out, int64_t N, int R, float scale, int64_t c0, int64_t c1,
                            bool nvec) {
  constexpr int U = NRG >= 4 ? 1 : 2;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const uint16_t* xa = reinterpret_cast<const uint16_t*>(smem + lay.off_xa);
  const int* s_orow = reinterpret_cast<const int*>(smem + lay.off_orow);
  const int nmt = int((c1 - c0 + 15) / 16), nks = lay.r16 / 16, xs = lay.xs;
  const int nrg = (nrows + 7) / 8;
  for (int base = w; base < nmt; base += kCellWarps * U) {
    float acc[U][NRG][4];
    uint32_t ob[U][NRG][2];
    int64_t col[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      col[u] = c0 + int64_t(base + kCellWarps * u) * 16 + 2 * g;
      const bool uv = base + kCellWarps * u < nmt;
#pragma unroll
      for (int r = 0; r < NRG; ++r) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[u][r][i] = 0.f;
        ob[u][r][0] = ob[u][r][1] = 0u;
        if (!uv || r >= nrg) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int q = r * 8 + 2 * t + h;
          if (q >= nrows) continue;
          const uint16_t* o = out + int64_t(s_orow[q]) * N + col[u];
          if (nvec && col[u] + 1 < c1) {
            ob[u][r][h] = *reinterpret_cast<const uint32_t*>(o);
          } else {
            const uint32_t lo = col[u] < c1 ? uint32_t(o[0]) : 0u;
            const uint32_t hi = col[u] + 1 < c1 ? uint32_t(o[1]) : 0u;
            ob[u][r][h] = lo | (hi << 16);
          }
        }
      }
    }
    for (int ks = 0; ks < nks; ++ks) {
      const int j = ks * 16 + 4 * t;
      const bool jv = j < R;  // R % 8 == 0: 4 valid or none
      uint2 b0[U], b1[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        b0[u] = b1[u] = make_uint2(0u, 0u);
        if (!jv || base + kCellWarps * u >= nmt) continue;
        if (col[u] < c1) b0[u] = __ldg(reinterpret_cast<const uint2*>(B + col[u] * R + j));
        if (col[u] + 1 < c1)
          b1[u] = __ldg(reinterpret_cast<const uint2*>(B + (col[u] + 1) * R + j));
      }
#pragma unroll
      for (int r = 0; r < NRG; ++r) {
        if (r >= nrg) continue;
        const uint2 xf = *reinterpret_cast<const uint2*>(xa + (r * 8 + g) * xs + ks * 16 + 4 * t);
#pragma unroll
        for (int u = 0; u < U; ++u)
          Mma<D>::run(acc[u][r], b0[u].x, b1[u].x, b0[u].y, b1[u].y, xf.x, xf.y);
      }
    }
    // c0 (col, row 2t), c1 (col, row 2t+1), c2 (col+1, row 2t), c3 (col+1, row 2t+1)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + kCellWarps * u >= nmt) continue;
#pragma unroll
      for (int r = 0; r < NRG; ++r) {
        if (r >= nrg) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int q = r * 8 + 2 * t + h;
          if (q >= nrows) continue;
          const float d0 = h2f<D>(f2h<D>(acc[u][r][h]));
          const float d1 = h2f<D>(f2h<D>(acc[u][r][2 + h]));
          const uint32_t o = ob[u][r][h];
          const uint32_t n0 = f2h<D>(fold_add(h2f<D>(uint16_t(o & 0xffffu)), scale, d0));
          const uint32_t n1 = f2h<D>(fold_add(h2f<D>(uint16_t(o >> 16)), scale, d1));
          uint16_t* dst = out + int64_t(s_orow[q]) * N + col[u];
          if (nvec && col[u] + 1 < c1) {
            *reinterpret_cast<uint32_t*>(dst) = n0 | (n1 << 16);
          } else {
            if (col[u] < c1) dst[0] = uint16_t(n0);
            if (col[u] + 1 < c1) dst[1] = uint16_t(n1);
          }
        }
      }
    }
  }
}

// Start the batch's output columns [c0, c1) on their way into L2.
__device__ __forceinline__ void prefetch_out_rows(const uint16_t* out, const int* s_orow, int nrows,
                                                  int64_t N, int64_t c0, int64_t c1) {
  const int64_t bytes = (c1 - c0) * 2, lines = (bytes + 127) / 128;
  for (int64_t i = threadIdx.x; i < nrows * lines; i += blockDim.x) {
    const int64_t q = i / lines, li = i - q * lines;
    prefetch_l2(reinterpret_cast<const char*>(out + int64_t(s_orow[q]) * N + c0) + li * 128);
  }
}

struct CellParams {
  int stages;
  int64_t chunk_w;  // output columns per CTA (multiple of 64)
  bool nvec;
};

template <DType D, int NRG>
__global__ void __launch_bounds__(kCellThreads, 2) grouped_cells_kernel(const GroupedParams prm,
                                                                      const CellParams cp) {
  constexpr int MR = 8 * NRG;
  static_assert(MR <= 64, "tile rows");
  extern __shared__ __align__(128) char smem[];
  const GroupedArgs& a = prm.a;
  const CellLayout lay(NRG, int(a.R), cp.stages);
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t lo = max(int64_t(0), a.row_offset), hi = min(a.row_end, a.te);
  const int E = prm.e_eff, R = int(a.R);
  const int64_t c0 = int64_t(blockIdx.y) * cp.chunk_w, c1 = min(a.N, c0 + cp.chunk_w);
  int* s_misc = reinterpret_cast<int*>(smem + lay.off_misc);
  int* s_l = reinterpret_cast<int*>(smem + lay.off_list);  // [64] table row or -1
  int* s_tok = s_l + 64;
  int* s_xrow = reinterpret_cast<int*>(smem + lay.off_xrow);
  int* s_orow = reinterpret_cast<int*>(smem + lay.off_orow);
  auto span = [&](int e, int64_t* start, int64_t* len) {
    int64_t s0 = a.expert_offsets[e], s1 = a.expert_offsets[e + 1];
    s0 = min(max(s0, lo), hi);
    s1 = min(max(s1, s0), hi);
    *start = s0;
    *len = s1 - s0;
  };
  int local_max = 0;
  for (int e = tid; e < E; e += kCellThreads) {
    int64_t st, ln;
    span(e, &st, &ln);
    local_max = max(local_max, int((ln + MR - 1) / MR));
  }
  local_max = __reduce_max_sync(0xffffffffu, local_max);
  if (lane == 0) s_misc[tid >> 5] = local_max;
  __syncthreads();
  int max_tiles = 0;
#pragma unroll
  for (int i = 0; i < kCellWarps; ++i) max_tiles = max(max_tiles, s_misc[i]);
  __syncthreads();
  const RouteView& rt = a.route;
  const bool need_tok = a.x_gather || a.has_row_adapter;
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  uint16_t* out = static_cast<uint16_t*>(a.out);
  const int64_t total_v = int64_t(E) * max_tiles;
  for (int64_t v = blockIdx.x; v < total_v; v += gridDim.x) {
    const int i = int(v / E), e = int(v % E);
    int64_t st, ln;
    span(e, &st, &ln);
    const int64_t r0 = st + int64_t(i) * MR;
    if (r0 >= st + ln) continue;  // uniform over the CTA
    const int cnt = int(min(int64_t(MR), st + ln - r0));
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
    const int v0 = s_l[lane], v1 = s_l[lane + 32];
    int prev = -1;
    for (;;) {
      // the next table row present in the tile (every warp computes the same)
      const int m0 = v0 > prev ? v0 : INT_MAX, m1 = v1 > prev ? v1 : INT_MAX;
      const int cur = __reduce_min_sync(0xffffffffu, min(m0, m1));
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
          const int r = int(r0 + tid);
          s_orow[pos] = r;
          s_xrow[pos] = a.x_gather ? s_tok[tid] : r;
        }
      }
      __syncthreads();
      prefetch_out_rows(out, s_orow, nrows, a.N, c0, c1);
      const uint16_t* A = static_cast<const uint16_t*>(a.a_pool) + int64_t(pair.a) * R * a.K;
      const uint16_t* B = static_cast<const uint16_t*>(a.b_pool) + int64_t(pair.b) * a.N * R;
      cell_shrink<D, NRG>(smem, lay, nrows, x, A, a.K, R);
      cell_expand<D, NRG>(smem, lay, nrows, B, out, a.N, R, pair.scale, c0, c1, cp.nvec);
      __syncthreads();  // s_xrow, s_orow and xa are rewritten by the next pass
    }
    __syncthreads();  // s_l and s_tok are rewritten by the next tile
  }
}

// ------------------------------------------------------------- host --------

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
bool aligned4(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) == 0; }

int sm_count() {
  static int n = [] {
    int dev = 0, v = 132;
    if (cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess)
      return v;
    return 132;
  }();
  return n;
}

// Raise a kernel's dynamic shared-memory limit to `smem_bytes` on the current
// device (a host-side attribute, no stream operation; cached per device).
cudaError_t ensure_smem(const void* kernel, int smem_bytes) {
  if (smem_bytes <= 48 * 1024) return cudaSuccess;
  static std::mutex mu;
  static std::unordered_map<const void*, int> raised[64];
  int dev = 0;
  if (const cudaError_t err = cudaGetDevice(&dev); err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  int& have = raised[dev & 63][kernel];
  if (smem_bytes > have) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return err;
    have = smem_bytes;
  }
  return cudaSuccess;
}

template <class Params>
cudaError_t launch(void (*kernel)(Params), const Params& prm, int64_t n_ctas, int C, int threads,
                   int smem_bytes, cudaStream_t stream) {
  if (n_ctas <= 0) return cudaSuccess;
  if (const cudaError_t err = ensure_smem(reinterpret_cast<const void*>(kernel), smem_bytes);
      err != cudaSuccess)
    return err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(n_ctas), 1, 1);
  cfg.blockDim = dim3(unsigned(threads), 1, 1);
  cfg.dynamicSmemBytes = size_t(smem_bytes);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(C);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = C > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, prm);
}

// The one-CTA-a-row kernel reads x and A rows with 16-byte loads: K % 8 == 0
// and aligned pools (XLA's buffers are). Other shapes take the seed kernels.
bool rows_kernel_fits(const GatherArgs& a) {
  return a.K % 8 == 0 && aligned16(a.x) && aligned16(a.a_pool) && aligned16(a.b_pool);
}

template <DType D>
cudaError_t gather_rows(const GatherArgs& a, cudaStream_t stream) {
  // Enough CTAs for every SM: split the columns of few rows into chunks of
  // whole kRowThreads multiples (each chunk recomputes xa from L2).
  const int64_t max_chunks = std::max<int64_t>(1, (a.N + kRowThreads - 1) / kRowThreads);
  const int64_t want = std::max<int64_t>(1, (sm_count() + a.n_slots - 1) / a.n_slots);
  const int64_t chunks0 = std::min<int64_t>(std::min<int64_t>(want, max_chunks), 65535);
  int64_t chunk_w = (a.N + chunks0 - 1) / chunks0;
  chunk_w = (chunk_w + kRowThreads - 1) / kRowThreads * kRowThreads;
  const int64_t chunks = (a.N + chunk_w - 1) / chunk_w;
  gather_rows_kernel<D><<<dim3(unsigned(a.n_slots), unsigned(chunks), 1), kRowThreads, 0,
                          stream>>>(a, chunk_w);
  return cudaPeekAtLastError();
}

template <DType D>
cudaError_t grouped_tc(const GroupedArgs& a, cudaStream_t stream) {
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
  // MOELORA_FAST_GROUPED_C=1 forces the latter.
  static const int force_c = [] {
    const char* v = std::getenv("MOELORA_FAST_GROUPED_C");
    return v ? std::atoi(v) : 0;
  }();
  const int smem2 = Layout(NT, 2, 16, int(a.R), prm.smem_experts).total;
  if (force_c != 1 && 2 * smem2 <= 220 * 1024) {
    prm.n_clusters = std::min<int64_t>(tiles, sm_count());  // 2 CTAs per SM
    return launch(grouped_fast_kernel<D, NT, 2>, prm, prm.n_clusters * 2, 2, 512, smem2, stream);
  }
  prm.n_clusters = std::min<int64_t>(tiles, sm_count());  // one 1024-thread CTA per SM
  const int smem = Layout(NT, 1, 32, int(a.R), prm.smem_experts).total;
  return launch(grouped_fast_kernel<D, NT, 1>, prm, prm.n_clusters, 1, 1024, smem, stream);
}

// Output columns per CTA for `units` units of work: enough CTAs for every SM,
// chunks of whole 64-column multiples (each chunk repeats the shrink).
int64_t cell_chunk_w(int64_t N, int64_t units) {
  int64_t chunks = std::max<int64_t>(1, sm_count() / std::max<int64_t>(1, units));
  chunks = std::min<int64_t>({chunks, (N + 63) / 64, 65535});
  int64_t w = (N + chunks - 1) / chunks;
  return (w + 63) / 64 * 64;
}

template <DType D, int NRG>
cudaError_t grouped_cells_nrg(const GroupedArgs& a, cudaStream_t stream) {
  constexpr int MR = 8 * NRG;
  GroupedParams prm = {};
  prm.a = a;
  const int64_t lo = std::max<int64_t>(0, a.row_offset), hi = std::min<int64_t>(a.row_end, a.te);
  if (hi <= lo) return cudaSuccess;
  prm.e_eff = int(std::min<int64_t>(a.route.n_experts, a.num_experts));
  if (prm.e_eff <= 0) return cudaSuccess;
  CellParams cp;
  cp.stages = CellLayout::stages_for(NRG, int(a.R));
  const CellLayout lay(NRG, int(a.R), cp.stages);
  const int64_t tiles = (hi - lo + MR - 1) / MR + prm.e_eff;
  cp.chunk_w = cell_chunk_w(a.N, tiles);
  cp.nvec = a.N % 2 == 0 && aligned4(a.out);
  const int64_t chunks = (a.N + cp.chunk_w - 1) / cp.chunk_w;
  auto kernel = grouped_cells_kernel<D, NRG>;
  if (const cudaError_t err = ensure_smem(reinterpret_cast<const void*>(kernel), lay.total);
      err != cudaSuccess)
    return err;
  int per_sm = 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kCellThreads, lay.total) !=
          cudaSuccess ||
      per_sm < 1)
    per_sm = 1;
  const int64_t ctas = std::min<int64_t>(tiles, int64_t(sm_count()) * per_sm);
  kernel<<<dim3(unsigned(ctas), unsigned(chunks), 1), kCellThreads, lay.total, stream>>>(prm, cp);
  return cudaPeekAtLastError();
}

// Prefill tiles of 64 rows at rank <= 16, 32 at rank <= 32, else 16 (the
// accumulators of a warp stay at 8 tensor-core tiles).
template <DType D>
cudaError_t grouped_cells(const GroupedArgs& a, cudaStream_t stream) {
  if (a.R <= 16) return grouped_cells_nrg<D, 8>(a, stream);
  if (a.R <= 32) return grouped_cells_nrg<D, 4>(a, stream);
  return grouped_cells_nrg<D, 2>(a, stream);
}

// MOELORA_FAST_GROUPED=tc forces the v2b tensor-core kernel (measurements).
bool grouped_use_tc() {
  static const bool tc = [] {
    const char* v = std::getenv("MOELORA_FAST_GROUPED");
    return v && std::string(v) == "tc";
  }();
  return tc;
}

// The cells kernels read x and A with 16-byte copies and keep row ids in int.
bool cells_fit(const void* x, const void* a_pool, const void* b_pool, int64_t K, int64_t rows) {
  return K % 8 == 0 && aligned16(x) && aligned16(a_pool) && aligned16(b_pool) && rows < INT_MAX;
}


// The cells kernel streams a pair's A block once per (tile, table row) pass;
// tiles shared by several adapters at long K (Mixtral-sized) run faster on the
// v2b kernel's 32-row tiles (docs/perf.md, v4).
bool use_grouped_cells(const GroupedArgs& a) {
  if (grouped_use_tc() || !cells_fit(a.x, a.a_pool, a.b_pool, a.K, a.te)) return false;
  return !(a.route.num_loras > 1 && a.K >= 4096);
}

}  // namespace

cudaError_t launch_gather_fast(const GatherArgs& args, cudaStream_t stream) {
  if (args.n_slots <= 0 || args.N <= 0 || args.K <= 0 || args.R <= 0) return cudaSuccess;
  switch (args.dtype) {
    case DType::kBf16:
      return rows_kernel_fits(args) ? gather_rows<DType::kBf16>(args, stream)
                                    : launch_gather_seed(args, stream);
    case DType::kF16:
      return rows_kernel_fits(args) ? gather_rows<DType::kF16>(args, stream)
                                    : launch_gather_seed(args, stream);
    case DType::kF32: {
      const dim3 grid(unsigned(args.n_slots), unsigned((args.N + kF32Cols - 1) / kF32Cols), 1);
      gather_f32_kernel<<<grid, kF32Threads, 0, stream>>>(args);
      return cudaPeekAtLastError();
    }
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_grouped_fast(const GroupedArgs& args, cudaStream_t stream) {
  if (args.te <= 0 || args.N <= 0 || args.K <= 0 || args.R <= 0) return cudaSuccess;
  switch (args.dtype) {
    case DType::kBf16:
      return use_grouped_cells(args) ? grouped_cells<DType::kBf16>(args, stream)
                                     : grouped_tc<DType::kBf16>(args, stream);
    case DType::kF16:
      return use_grouped_cells(args) ? grouped_cells<DType::kF16>(args, stream)
                                     : grouped_tc<DType::kF16>(args, stream);
    case DType::kF32: {
      const int64_t lo = std::max<int64_t>(0, args.row_offset);
      const int64_t hi = std::min<int64_t>(args.row_end, args.te);
      if (hi <= lo) return cudaSuccess;
      const dim3 grid(unsigned(hi - lo), unsigned((args.N + kF32Cols - 1) / kF32Cols), 1);
      grouped_f32_kernel<<<grid, kF32Threads, 0, stream>>>(args, lo);
      return cudaPeekAtLastError();
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace moelora
