// The LoRA expand in expert_matmul's GEMM epilogue: a CUTLASS sm90 fusion
// callbacks type (passed to the epilogue builder in place of a fusion
// operation) that folds each row's delta into the accumulators before the
// single store, so the GEMM output is written once and never read back.
//
// Before the GEMM the grouped shrink (ffi_src/fast/prefill_shrink.cu) has
// written, per weight set, xa [rows, r] (round(x . A) of every folding row)
// and each row's pair {b slot, scale} (b 0: the row does not fold). Per
// output tile (128 x 128) each consumer warp owns 16 rows; in begin() it
// reads its rows' pairs and xa in begin(); before each 32-column epilogue
// subtile it reads those columns of the B blocks and computes
// delta = round(xa . B^T) on the tensor cores (mma m16n8k16, one pass per
// distinct b slot among its 16 rows, rank steps of 16). visit()
// then returns, per element,
//   round(acc)                                  rows that do not fold,
//   round(acc) + scale * delta (fold_add)       rows that fold,
// and the epilogue's conversion rounds it to the output dtype: the roundings
// of the grouped fold (docs/semantics.md §5) applied to round(acc), the
// GEMM output without LoRA; rows that do not fold are bit-identical to it.
//
// The callbacks rely on the accumulator layout of sm90 wgmma, the same for
// every consumer warp: a thread holds rows m and m + 8 of its warp's 16-row
// slab (m = slab + lane / 4) and, in each 8-column block, columns
// 2 (lane % 4) and 2 (lane % 4) + 1: the C fragment of mma.sync m16n8k16, so
// the thread's deltas are its own mma outputs. The element offsets used in
// visit() come from the epilogue's static coordinate tensor.
#pragma once

#include <climits>

#include "expert_matmul.h"
#include "fast/fast_common.cuh"

#include "cute/tensor.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

namespace moelora::expert_gemm {

constexpr int kLoraTileCols = 128;              // the GEMM tile's N
constexpr int kLoraBlocks = kLoraTileCols / 8;  // 8-column mma blocks a tile
constexpr int kLoraMaxSteps = kLoraEpilogueMaxRank / 16;

// Run f(std::integral_constant<int, KS>) with KS rank steps of 16 covering
// `steps` (1, 2 or 4).
template <class F>
__device__ __forceinline__ void with_steps(int steps, F&& f) {
  if (steps <= 1)
    f(std::integral_constant<int, 1>{});
  else if (steps <= 2)
    f(std::integral_constant<int, 2>{});
  else
    f(std::integral_constant<int, 4>{});
}

// A warp's deltas of one b slot over NB 8-column blocks starting at column
// col0, KS rank steps: blocks in groups of G, each group's B fragments
// loaded at once (8 G registers), then multiplied; the results replace dpk
// for the thread's rows in the cell (in0: row m, in1: row m + 8).
template <DType D, int KS, int NB>
__device__ __forceinline__ void lora_blocks(uint32_t (&dpk)[NB][2], const uint32_t (&am)[KS][4],
                                            bool in0, bool in1, const uint16_t* B, int r,
                                            int col0, int N, int lane) {
  constexpr int G = NB < kLoraBlocks / KS ? NB : kLoraBlocks / KS;
  const int kq = 2 * (lane & 3);
#pragma unroll
  for (int q = 0; q < NB; q += G) {
    uint32_t bf[G][KS][2];
#pragma unroll
    for (int jb = 0; jb < G; ++jb) {
      const int n = col0 + 8 * (q + jb) + (lane >> 2);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int hk = 0; hk < 2; ++hk) {
          const int k = 16 * ks + kq + 8 * hk;
          bf[jb][ks][hk] = (n < N && k < r)
                               ? *reinterpret_cast<const uint32_t*>(B + int64_t(n) * r + k)
                               : 0u;
        }
    }
#pragma unroll
    for (int jb = 0; jb < G; ++jb) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        fast::Mma<D>::run(acc, am[ks][0], am[ks][1], am[ks][2], am[ks][3], bf[jb][ks][0],
                          bf[jb][ks][1]);
      if (in0) dpk[q + jb][0] = fast::pack2<D>(acc[0], acc[1]);
      if (in1) dpk[q + jb][1] = fast::pack2<D>(acc[2], acc[3]);
    }
  }
}

// The callbacks of one tile. The whole tile's deltas are computed in
// begin(), so that a tile waits for two dependent rounds of loads (the rows'
// pairs, then xa and the B columns of all 16 blocks at rank 16) rather
// than one more round per epilogue subtile.
template <DType D, class CoordTensor>
struct LoraStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
  static constexpr int NB = kLoraBlocks;
  CUTLASS_DEVICE
  LoraStoreCallbacks(CoordTensor tCcD_, LoraEpilogueArgs const& args_, int group_, int M_, int N_,
                     int m_first_, int n_tile0_, int lane_)
      : tCcD(tCcD_), args(args_), group(group_), M(M_), N(N_), m_first(m_first_),
        n_tile0(n_tile0_), lane(lane_) {}

  CoordTensor tCcD;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N), relative to the thread's first element
  LoraEpilogueArgs const& args;
  int group, M, N, m_first, n_tile0, lane;
  bool active = false;  // the weight set has LoRA and the expert a table column (CTA-uniform)
  bool fold[2] = {false, false};  // rows m_first and m_first + 8 fold
  float scale[2] = {0.f, 0.f};
  uint32_t dpk[NB][2];  // rounded deltas: [block][row half], two columns packed

  CUTLASS_DEVICE void begin() {
    const int wi = group / args.E, e = group - wi * args.E;
    // the weight set's fields by selection: a dynamic index into the kernel
    // parameters would copy them to local memory
    LoraSet s = args.set[0];
#pragma unroll
    for (int i = 1; i < kExpertMatmulMaxWeights; ++i)
      if (wi == i) s = args.set[i];
    active = s.b_pool != nullptr && e < s.n_experts;
    if (!active) return;
    const int64_t row0 = args.offsets[e];  // the sorted row of the problem's row 0
    int b[2] = {0, 0};                     // b slots of the two rows (0: no fold)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m_first + 8 * h;
      if (m < M) {
        const int2 pr = *reinterpret_cast<const int2*>(s.row_pairs + 2 * (row0 + m));
        b[h] = pr.x;
        scale[h] = __int_as_float(pr.y);
      }
      fold[h] = b[h] > 0;
    }
#pragma unroll
    for (int j = 0; j < NB; ++j) dpk[j][0] = dpk[j][1] = 0u;
    with_steps((s.r + 15) / 16, [&](auto ks_c) { deltas<decltype(ks_c)::value>(s, row0, b); });
  }

  // dpk over the tile, KS rank steps: the two rows' xa fragments (a0 row m
  // k, a1 row m + 8 k, a2 and a3 at k + 8; zero past the rank and for rows
  // that do not fold), then one pass per distinct b slot among the warp's
  // 16 rows, in slot order.
  template <int KS>
  CUTLASS_DEVICE void deltas(const LoraSet& s, int64_t row0, const int (&b)[2]) {
    uint32_t af[KS][4];
    const int kq = 2 * (lane & 3);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int hk = 0; hk < 2; ++hk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int k = 16 * ks + kq + 8 * hk;
          af[ks][2 * hk + h] =
              (fold[h] && k < s.r)
                  ? *reinterpret_cast<const uint32_t*>(s.xa + (row0 + m_first + 8 * h) * s.r + k)
                  : 0u;
        }
    int prev = 0;
    for (;;) {
      const int c0 = b[0] > prev ? b[0] : INT_MAX, c1 = b[1] > prev ? b[1] : INT_MAX;
      const int cur = __reduce_min_sync(0xffffffffu, c0 < c1 ? c0 : c1);
      if (cur == INT_MAX) break;
      prev = cur;
      const bool in0 = b[0] == cur, in1 = b[1] == cur;
      uint32_t am[KS][4];
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        am[ks][0] = in0 ? af[ks][0] : 0u;
        am[ks][1] = in1 ? af[ks][1] : 0u;
        am[ks][2] = in0 ? af[ks][2] : 0u;
        am[ks][3] = in1 ? af[ks][3] : 0u;
      }
      lora_blocks<D, KS, NB>(dpk, am, in0, in1, s.b_pool + int64_t(cur) * N * s.r, s.r, n_tile0,
                             N, lane);
    }
  }

  template <class ElementAccumulator, int FragmentSize>
  CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(
      cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int epi_m,
      int epi_n) {
    using cute::_;
    cutlass::Array<float, FragmentSize> out;
    auto crd = tCcD(_, _, _, epi_m, epi_n);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < FragmentSize; ++i) {
      const float base = Traits<D>::to_f(Traits<D>::from_f(float(frg_acc[i])));
      float v = base;
      if (active) {
        const auto c = crd(epi_v * FragmentSize + i);
        const int dm = int(cute::get<0>(c)), dn = int(cute::get<1>(c));
        const int h = (dm >> 3) & 1, j = (dn >> 3) & (NB - 1);
        const uint32_t pk = dpk[j][h];
        const float d = fast::h2f<D>(uint16_t((dn & 1) ? (pk >> 16) : (pk & 0xffffu)));
        if (fold[h]) v = fold_add(base, scale[h], d);
      }
      out[i] = v;
    }
    return out;
  }
};

// The fusion callbacks type: no shared memory, no producer loads, no
// workspace; its arguments are LoraEpilogueArgs (expert_matmul.h).
template <DType D>
struct LoraEpilogue {
  struct SharedStorage {};
  using Arguments = LoraEpilogueArgs;
  using Params = LoraEpilogueArgs;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) { return true; }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE LoraEpilogue() {}
  CUTLASS_HOST_DEVICE LoraEpilogue(Params const& p, SharedStorage const&) : params(p) {}

  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(
      cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& a) {
    auto [M, N, K, L] = a.problem_shape_mnkl;
    auto [m, n, k, l] = a.tile_coord_mnkl;
    const int m_first = int(M) - int(cute::get<0>(a.residue_tCcD));
    static_assert(int(cute::size<1>(decltype(a.tile_shape_mnk){})) == kLoraTileCols,
                  "the LoRA epilogue assumes 128-column tiles");
    return LoraStoreCallbacks<D, decltype(a.tCcD)>(a.tCcD, params, int(l), int(M), int(N),
                                                   m_first, int(n) * kLoraTileCols,
                                                   a.thread_idx & 31);
  }
};

}  // namespace moelora::expert_gemm
