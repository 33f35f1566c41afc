// A CUTLASS 4.2 sm90 ptr-array mainloop whose K loop runs on past a group's
// own K over a second operand pair, into the same accumulator:
//
//   D_g = round(A_g B_g + A2_g B2_g)     A_g [M, k], B_g [k, N]; A2_g [M, k_ext], B2_g [k_ext, N]
//
// expert_matmul folds the LoRA delta so (docs/expert_matmul.md, "The LoRA
// inside the GEMM"): A2 holds each row's shrink round(x A^T) in its adapter's
// R columns (zero elsewhere), B2 the expert's round(scale * B^T) blocks of
// every adapter stacked along K, so the delta costs ceil(k_ext / BLK_K) more
// K steps of the tile's own MMA and the output is written once.
//
// The K steps of a group: ceil(k / BLK_K) over (A, B), then ceil(k_ext /
// BLK_K) over (A2, B2); the group's problem K is round_up(k, BLK_K) + k_ext
// (SplitK holds k and k_ext, since the problem K alone cannot say where the
// base K ends). TMA fills the parts of a box past k (or k_ext) with zeros,
// which add nothing, so a row whose A2 row is zero gets the bits of the GEMM
// without the extension. The second pair is loaded through two more tensor
// maps per SM, built from the first pair's (same element types, layouts,
// boxes and swizzles) with the group's addresses, extents and strides. The
// consumer warpgroups run the base mainloop's MMA loop unchanged: they see
// ceil(K / BLK_K) stages whatever fills them.
//
// Everything else (tile scheduler, epilogue, kernel) is CUTLASS's: the kernel
// calls the mainloop's members by name, and this type derives from the
// builder's mainloop, replacing the members that touch the operands.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace moelora::expert_gemm {

// A group's K split: the base pair's k and the extension's k_ext (0: none).
struct SplitK {
  int32_t k;
  int32_t k_ext;
};

template <class Base>
struct LoraKMainloop : Base {
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::InternalElementA;
  using typename Base::InternalElementB;
  using typename Base::InternalStrideA;
  using typename Base::InternalStrideB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;

  static_assert(cute::size(typename Base::DispatchPolicy::ClusterShape{}) == 1, "one CTA per cluster (no multicast)");
  static_assert(Base::IsGroupedGemmKernel, "per-group strides");
  static constexpr int kBlkK = cute::size<2>(TileShape{});

  struct Arguments {
    ElementA const** ptr_A;
    StrideA dA;
    ElementB const** ptr_B;
    StrideB dB;
    ElementA const** ptr_A2;  // per group; read only where k_ext > 0
    StrideA dA2;
    ElementB const** ptr_B2;
    StrideB dB2;
    SplitK const* split_k;    // per group
  };

  struct Params : Base::Params {
    InternalElementA const** ptr_A2;
    StrideA dA2;
    InternalElementB const** ptr_B2;
    StrideB dB2;
    SplitK const* split_k;
  };

  struct TensorMapStorage : cute::aligned_struct<128, cute::_0> {
    cute::TmaDescriptor smem_tensormap_A;
    cute::TmaDescriptor smem_tensormap_B;
    cute::TmaDescriptor smem_tensormap_A2;
    cute::TmaDescriptor smem_tensormap_B2;
  };

  static typename Base::Arguments base_arguments(Arguments const& a) {
    return {a.ptr_A, a.dA, a.ptr_B, a.dB};
  }

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape shapes, Arguments const& a,
                                                  void* workspace) {
    Params p{};
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(shapes, base_arguments(a), workspace);
    p.ptr_A2 = reinterpret_cast<InternalElementA const**>(a.ptr_A2);
    p.dA2 = a.dA2;
    p.ptr_B2 = reinterpret_cast<InternalElementB const**>(a.ptr_B2);
    p.dB2 = a.dB2;
    p.split_k = a.split_k;
    return p;
  }

  // Four tensor maps per SM: A, B, A2, B2.
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int sm_count) {
    return 4 * sizeof(cute::TmaDescriptor) * size_t(sm_count);
  }

  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape shapes, Arguments const& a) {
    return Base::can_implement(shapes, base_arguments(a));
  }

  // K steps of the current group over the base pair (set by
  // tensormaps_perform_update, which the producer warp calls for a group
  // before it loads the group's tiles).
  int base_k_tiles_ = 0;

  template <class TensorA, class TensorB, class TensorMaps, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           TensorMaps const& tensormaps, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int /*thread_idx*/,
                           uint32_t /*block_rank_in_cluster*/, TensorStorage& shared_tensors) {
    using namespace cute;
    if (!elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                            typename Base::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()),
                            typename Base::SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    auto tma_a = params.tma_load_a.get_slice(0);
    auto tma_b = params.tma_load_b.get_slice(0);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    // TMA coordinates (BLK, BLK_K, k): the same for both pairs, each pair
    // counting its own K steps from 0.
    Tensor tAgA = tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tAsA = tma_a.partition_D(sA);
    Tensor tBgB = tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tBsB = tma_b.partition_D(sB);
    const int base_tiles = base_k_tiles_;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count, ++k_tile_iter, ++smem_pipe_write) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const int k = *k_tile_iter;
      if (k < base_tiles) {
        copy(params.tma_load_a.with(get<0>(tensormaps), *barrier, 0), tAgA(_, _, _, k),
             tAsA(_, _, _, stage));
        copy(params.tma_load_b.with(get<1>(tensormaps), *barrier, 0), tBgB(_, _, _, k),
             tBsB(_, _, _, stage));
      } else {
        copy(params.tma_load_a.with(get<2>(tensormaps), *barrier, 0), tAgA(_, _, _, k - base_tiles),
             tAsA(_, _, _, stage));
        copy(params.tma_load_b.with(get<3>(tensormaps), *barrier, 0), tBgB(_, _, _, k - base_tiles),
             tBsB(_, _, _, stage));
      }
    }
  }

  CUTLASS_DEVICE auto tensormaps_init(Params const& params, TensorMapStorage& smem, int32_t sm_count,
                                      int32_t sm_idx) {
    using namespace cute;
    TmaDescriptor* gmem = reinterpret_cast<TmaDescriptor*>(params.tensormaps);
    if (elect_one_sync()) {
      // A2 and B2 start as copies of A's and B's maps (same boxes and swizzles).
      Tensor pA = make_tensor(params.tma_load_a.get_tma_descriptor(), Int<1>{}, Int<1>{});
      Tensor pB = make_tensor(params.tma_load_b.get_tma_descriptor(), Int<1>{}, Int<1>{});
      TmaDescriptor* dst[4] = {&smem.smem_tensormap_A, &smem.smem_tensormap_B,
                               &smem.smem_tensormap_A2, &smem.smem_tensormap_B2};
      for (int i = 0; i < 4; ++i) {
        Tensor s = make_tensor(make_smem_ptr(dst[i]), Int<1>{}, Int<1>{});
        copy(recast<uint128_t>(i % 2 == 0 ? pA : pB), recast<uint128_t>(s));
      }
    }
    __syncwarp();
    return make_tuple(&gmem[sm_idx], &gmem[sm_idx + sm_count], &gmem[sm_idx + 2 * sm_count],
                      &gmem[sm_idx + 3 * sm_count]);
  }

  template <class TensorMaps, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage& smem, Params const& params,
                                                TensorMaps const&, ProblemShape_MNKL shape,
                                                int32_t group) {
    const SplitK split = params.split_k[group];
    base_k_tiles_ = (split.k + kBlkK - 1) / kBlkK;
    if (cute::elect_one_sync()) {
      const uint32_t M = cute::get<0>(shape), N = cute::get<1>(shape);
      cute::tma_descriptor_replace_addr_in_shared_mem(smem.smem_tensormap_A, params.ptr_A[group]);
      cute::tma_descriptor_replace_addr_in_shared_mem(smem.smem_tensormap_B, params.ptr_B[group]);
      replace_extents(smem.smem_tensormap_A, params.tma_load_a, M, split.k, params.dA[group],
                      static_cast<InternalElementA const*>(nullptr));
      replace_extents(smem.smem_tensormap_B, params.tma_load_b, N, split.k, params.dB[group],
                      static_cast<InternalElementB const*>(nullptr));
      if (split.k_ext > 0) {
        cute::tma_descriptor_replace_addr_in_shared_mem(smem.smem_tensormap_A2,
                                                        params.ptr_A2[group]);
        cute::tma_descriptor_replace_addr_in_shared_mem(smem.smem_tensormap_B2,
                                                        params.ptr_B2[group]);
        replace_extents(smem.smem_tensormap_A2, params.tma_load_a, M, split.k_ext,
                        params.dA2[group], static_cast<InternalElementA const*>(nullptr));
        replace_extents(smem.smem_tensormap_B2, params.tma_load_b, N, split.k_ext,
                        params.dB2[group], static_cast<InternalElementB const*>(nullptr));
      }
    }
  }

  template <class TensorMaps>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage& smem,
                                                  TensorMaps const& tensormaps) {
    if (cute::elect_one_sync()) {
      cute::tma_desc_commit_group();
      cute::tma_desc_wait_group();
    }
    cute::tma_descriptor_cp_fence_release(cute::get<0>(tensormaps), smem.smem_tensormap_A);
    cute::tma_descriptor_cp_fence_release(cute::get<1>(tensormaps), smem.smem_tensormap_B);
    cute::tma_descriptor_cp_fence_release(cute::get<2>(tensormaps), smem.smem_tensormap_A2);
    cute::tma_descriptor_cp_fence_release(cute::get<3>(tensormaps), smem.smem_tensormap_B2);
  }

  template <class TensorMaps>
  CUTLASS_DEVICE void tensormaps_fence_acquire(TensorMaps const& tensormaps) {
    cute::tma_descriptor_fence_acquire(cute::get<0>(tensormaps));
    cute::tma_descriptor_fence_acquire(cute::get<1>(tensormaps));
    cute::tma_descriptor_fence_acquire(cute::get<2>(tensormaps));
    cute::tma_descriptor_fence_acquire(cute::get<3>(tensormaps));
  }

 private:
  // A tensor map's extents (rows, k) and strides for a group (in place, in
  // shared memory; the element pointer only types the tensor).
  template <class Tma, class Stride, class Element>
  CUTLASS_DEVICE static void replace_extents(cute::TmaDescriptor& desc, Tma const& tma,
                                             uint32_t rows, uint32_t k, Stride const& stride,
                                             Element const* typed_null) {
    using namespace cute;
    array<uint32_t, 5> dims = {1, 1, 1, 1, 1};
    array<uint64_t, 5> strides = {0, 0, 0, 0, 0};
    Tensor t = make_tensor(typed_null, make_shape(rows, k, Int<1>{}), stride);
    detail::fill_tma_gmem_shape_stride(tma, t, dims, strides);
    for (uint64_t& s : strides) s = (s * sizeof_bits_v<Element>) / 8;
    tma_descriptor_replace_dims_strides_in_shared_mem(desc, dims, strides);
  }
};

}  // namespace moelora::expert_gemm
