// The CUTLASS 4.2 kernel types of the library's grouped GEMMs: ptr-array
// grouped GEMMs for sm90 (TMA loads, wgmma, warp-specialized persistent
// kernel, cooperative or pingpong).
//
// A GemmConfig fixes the operand layouts (legacy CUTLASS tags over the
// (M, K) A and (K, N) B matrices) and the C and D element types:
//
//   forward (Config):  D[m_e, N] = round(x_e[m_e, K] @ w[e][K, N])
//                      A row-major (K-major); B row-major (N-major; wgmma reads
//                      it transposed from shared memory, 16-bit types); no C.
//   kGmm:              D = round(lhs_g @ rhs[slot] + beta * C), as the forward
//                      with a C operand (C = D: accumulate in place).
//   kGmmRhsT:          D = round(lhs_g @ rhs[slot]^T + beta * C): B column-major
//                      (K-major), the weights read transposed in place.
//   kTgmm:             D[K, N] (fp32) = lhs_g^T @ rhs_g over a group's rows:
//                      A column-major (M-major), B row-major (N-major); the
//                      group's rows are the reduction.
//
// fp32 accumulation everywhere. One problem per group; the problem shapes and
// pointers live in device memory and the host passes no shapes, so the
// persistent grid is one CTA per SM and the scheduler walks the groups on the
// device.
#pragma once

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "lora_k_mainloop.cuh"

namespace moelora::expert_gemm {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K)

// Tile 128 x 128 x 64, no cluster: groups are ragged and often a single M
// tile, so an M-cluster would idle.
using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;

// The two kernel schedules (ExpertMatmulSchedule in moelora_constants.h):
//   Cooperative: both consumer warpgroups share a tile (64 rows each); a tile's
//     epilogue runs after its mainloop, the tensor cores idle meanwhile.
//   Pingpong: each consumer warpgroup owns a whole tile and the two take turns,
//     so one's epilogue overlaps the other's mainloop (short K: the epilogue
//     is a larger share of a tile's time).
struct Cooperative {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// AlphaArray: D = alpha_g * acc (+ beta * C) with a per-group alpha read
// through a pointer array (the default: with a C operand); else alpha = 1.
template <class Element, class LayoutA_, class LayoutB_, class ElementC_, class ElementD_,
          class Schedule, bool AlphaArray = !std::is_void_v<ElementC_>>
struct GemmConfig {
  using ElementAB = Element;
  using ElementC = ElementC_;  // void: no C operand
  using ElementD = ElementD_;
  using LayoutA = LayoutA_;
  using LayoutB = LayoutB_;
  using LayoutD = RowMajor;
  static constexpr bool kHasC = !std::is_void_v<ElementC>;
  static constexpr bool kAlphaArray = AlphaArray;
  static constexpr bool kLoraK = false;  // LoraConfig: a second operand pair in the K loop
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;     // 16 bytes
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  static constexpr int kAlignC =
      kHasC ? 128 / cutlass::sizeof_bits<std::conditional_t<kHasC, ElementC, ElementD>>::value
            : kAlignD;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      ElementC, LayoutD*, kAlignC,
      ElementD, LayoutD*, kAlignD,
      typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA*, kAlign,
      Element, LayoutB*, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape = typename ProblemShape::UnderlyingProblemShape;
};

// expert_matmul's forward GEMM: x @ w[e], no C operand.
template <class Element, class Schedule>
using Config = GemmConfig<Element, RowMajor, RowMajor, void, Element, Schedule>;

// expert_matmul's forward GEMM with the LoRA delta in its K loop
// (lora_k_mainloop.cuh): round(x @ w[e] + xa_ext @ b_ext[e]), one store.
template <class Element, class Schedule>
struct LoraConfig : Config<Element, Schedule> {
  using Forward = Config<Element, Schedule>;
  static constexpr bool kLoraK = true;
  using CollectiveMainloop = LoraKMainloop<typename Forward::CollectiveMainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      typename Forward::CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace moelora::expert_gemm
