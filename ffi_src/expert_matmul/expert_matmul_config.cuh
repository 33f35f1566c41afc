// The CUTLASS 4.2 kernel types of expert_matmul: a ptr-array grouped GEMM for
// sm90 (TMA loads, wgmma, warp-specialized persistent kernel, cooperative or
// pingpong).
//
//   A = x rows of one expert     [m_e, K] row-major (K-major)
//   B = w[e]                     [K, N] row-major (N-major; wgmma reads it
//                                transposed from shared memory, 16-bit types)
//   D = out rows of that expert  [m_e, N] row-major, D = round(A @ B) with fp32
//                                accumulation; no C operand (ElementC = void).
// One problem per (weight set, expert); the problem shapes and pointers live
// in device memory and the host passes no shapes, so the persistent grid is
// one CTA per SM and the scheduler walks the groups on the device.
#pragma once

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

template <class Element, class Schedule>
struct Config {
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::RowMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 16 bytes

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlign,        // no C operand
      Element, LayoutD*, kAlign,
      typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>>::CollectiveOp;

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
  using StrideD = typename Kernel::InternalStrideD;
  using Shape = typename ProblemShape::UnderlyingProblemShape;
};

}  // namespace moelora::expert_gemm
