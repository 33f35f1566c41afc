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
// (LoraK holds k and k_ext, since the problem K alone cannot say where the
// base K ends). TMA fills the parts of a box past k (or k_ext) with zeros,
// which add nothing, so a row whose A2 row is zero gets the bits of the GEMM
// without the extension.
//
// The second pair is loaded through tensor maps of each weight set's whole
// operands, built on the host with the kernel's parameters: A2 over all the
// set's rows [M, k_ext], B2 over its experts' blocks [E, k_ext, N]; a group
// reads them at its first row and its expert (LoraK). They never change
// while the kernel runs, so a change of group updates and fences only the
// first pair's maps, as the plain kernel does. A tile of A2 may run past its
// group's rows into the next group's: those rows of the accumulator are not
// stored (the epilogue's map ends at the group's rows). The consumer
// warpgroups run the base mainloop's MMA loop unchanged: they see ceil(K /
// BLK_K) stages whatever fills them.
//
// Everything else (tile scheduler, epilogue, kernel) is CUTLASS's: the kernel
// calls the mainloop's members by name, and this type derives from the
// builder's mainloop, replacing the members that touch the operands.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "moelora_constants.h"

namespace moelora::expert_gemm {

// A group's K split (the base pair's k, the extension's k_ext: 0 for none)
// and where it reads the second pair: its first row of A2, its expert in B2,
// its weight set's maps.
struct LoraK {
  int32_t k;
  int32_t k_ext;
  int32_t ext_row;
  int32_t ext_expert;
  int32_t ext_set;
};

inline constexpr int kLoraKMaxSets = kExpertMatmulMaxWeights;  // weight sets of a launch

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
  using typename Base::TensorMapStorage;
  using typename Base::TileShape;
  using TMA_A = typename Base::TMA_A;

  static_assert(cute::size(typename Base::DispatchPolicy::ClusterShape{}) == 1, "one CTA per cluster (no multicast)");
  static_assert(Base::IsGroupedGemmKernel, "per-group strides");
  static_assert(cute::is_same_v<cute::remove_cvref_t<decltype(cute::get<0>(InternalStrideB{}))>,
                                cute::Int<1>>, "B is N-major");
  static constexpr int kBlkK = cute::size<2>(TileShape{});

  // B2 as (N, k_ext, expert): one more dynamic stride than B.
  using StrideB2 = cute::Stride<cute::Int<1>, int64_t, int64_t>;
  using TMA_B2 = decltype(cute::make_tma_copy(
      typename Base::GmemTiledCopyB{},
      cute::make_tensor(static_cast<InternalElementB const*>(nullptr),
                        cute::repeat_like(StrideB2{}, int32_t(0)), StrideB2{}),
      typename Base::SmemLayoutB{}(cute::_, cute::_, cute::Int<0>{}),
      cute::make_shape(cute::shape<1>(TileShape{}), cute::shape<2>(TileShape{})), cute::Int<1>{}));

  // A weight set's second pair, whole: a [rows, k_ext] row-major, b
  // [experts, k_ext, n] row-major. a == nullptr (or no rows, no experts):
  // no group of the set reads it.
  struct ExtPair {
    ElementA const* a;
    ElementB const* b;
    int32_t rows, k_ext, experts, n;
  };

  struct Arguments {
    ElementA const** ptr_A;
    StrideA dA;
    ElementB const** ptr_B;
    StrideB dB;
    ExtPair ext[kLoraKMaxSets];
    LoraK const* lora_k;  // per group
  };

  struct Params : Base::Params {
    TMA_A tma_load_a2[kLoraKMaxSets];
    TMA_B2 tma_load_b2[kLoraKMaxSets];
    ExtPair ext[kLoraKMaxSets];
    LoraK const* lora_k;
  };

  static typename Base::Arguments base_arguments(Arguments const& a) {
    return {a.ptr_A, a.dA, a.ptr_B, a.dB};
  }

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape shapes, Arguments const& a,
                                                  void* workspace) {
    using namespace cute;
    Params p{};
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(shapes, base_arguments(a), workspace);
    // A set without a second pair gets maps of a placeholder (never read):
    // the address of the pointer array, 16-byte aligned, as the base pair's,
    // with 16-byte strides.
    auto* any_a = reinterpret_cast<InternalElementA const*>(
        reinterpret_cast<uint64_t>(a.ptr_A) & 0xFFFFFFFFFFFFFFF0);
    auto* any_b = reinterpret_cast<InternalElementB const*>(
        reinterpret_cast<uint64_t>(a.ptr_B) & 0xFFFFFFFFFFFFFFF0);
    for (int s = 0; s < kLoraKMaxSets; ++s) {
      ExtPair e = a.ext[s];
      const bool on = e.a != nullptr && e.rows > 0 && e.experts > 0;
      if (!on) e = ExtPair{nullptr, nullptr, 1, 8, 1, 8};
      Tensor ta = make_tensor(on ? reinterpret_cast<InternalElementA const*>(e.a) : any_a,
                              make_layout(make_shape(e.rows, e.k_ext, 1),
                                          InternalStrideA{int64_t(e.k_ext), Int<1>{}, Int<0>{}}));
      Tensor tb = make_tensor(on ? reinterpret_cast<InternalElementB const*>(e.b) : any_b,
                              make_layout(make_shape(e.n, e.k_ext, e.experts),
                                          StrideB2{Int<1>{}, int64_t(e.n),
                                                   int64_t(e.n) * e.k_ext}));
      p.tma_load_a2[s] = make_tma_copy(typename Base::GmemTiledCopyA{}, ta,
                                       typename Base::SmemLayoutA{}(_, _, Int<0>{}),
                                       make_shape(shape<0>(TileShape{}), shape<2>(TileShape{})),
                                       Int<1>{});
      p.tma_load_b2[s] = make_tma_copy(typename Base::GmemTiledCopyB{}, tb,
                                       typename Base::SmemLayoutB{}(_, _, Int<0>{}),
                                       make_shape(shape<1>(TileShape{}), shape<2>(TileShape{})),
                                       Int<1>{});
      p.ext[s] = e;
    }
    p.lora_k = a.lora_k;
    return p;
  }

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const& shapes, Arguments const& a, int sm_count) {
    return Base::get_workspace_size(shapes, base_arguments(a), sm_count);
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

  // The current group's LoraK (set by tensors_perform_update, which the
  // producer warp calls for a group before it loads the group's tiles).
  LoraK group_{};

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& inputs,
                                                     Params const& params, ProblemShape_MNKL,
                                                     int32_t group) {
    group_ = params.lora_k[group];
    return inputs;
  }

  template <class TensorA, class TensorB, class TensorMaps, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           TensorMaps const& tensormaps, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int /*thread_idx*/,
                           uint32_t /*block_rank_in_cluster*/, TensorStorage& shared_tensors) {
    using namespace cute;
    if (!elect_one_sync()) return;
    if (group_.ext_set == 0)
      load_tile(params, params.tma_load_a2[0], params.tma_load_b2[0], params.ext[0], pipeline,
                smem_pipe_write, load_inputs, tensormaps, blk_coord, k_tile_iter, k_tile_count,
                shared_tensors);
    else
      load_tile(params, params.tma_load_a2[1], params.tma_load_b2[1], params.ext[1], pipeline,
                smem_pipe_write, load_inputs, tensormaps, blk_coord, k_tile_iter, k_tile_count,
                shared_tensors);
  }

  // A/B extents and addresses per group, the base K only (the problem K
  // counts the extension's steps too).
  template <class TensorMaps, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage& smem, Params const& params,
                                                TensorMaps const&, ProblemShape_MNKL shape,
                                                int32_t group) {
    if (cute::elect_one_sync()) {
      const uint32_t M = cute::get<0>(shape), N = cute::get<1>(shape);
      const uint32_t k = uint32_t(params.lora_k[group].k);
      cute::tma_descriptor_replace_addr_in_shared_mem(smem.smem_tensormap_A, params.ptr_A[group]);
      cute::tma_descriptor_replace_addr_in_shared_mem(smem.smem_tensormap_B, params.ptr_B[group]);
      replace_extents(smem.smem_tensormap_A, params.tma_load_a, M, k, params.dA[group],
                      static_cast<InternalElementA const*>(nullptr));
      replace_extents(smem.smem_tensormap_B, params.tma_load_b, N, k, params.dB[group],
                      static_cast<InternalElementB const*>(nullptr));
    }
  }

 private:
  // One tile's K steps: the base pair through the group's tensor maps, then
  // the second pair through its weight set's maps (in the kernel's parameters).
  template <class TensorA, class TensorB, class TensorMaps, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_tile(Params const& params, TMA_A const& tma_a2, TMA_B2 const& tma_b2,
                                ExtPair const& ext, MainloopPipeline& pipeline,
                                PipelineState& smem_pipe_write,
                                cute::tuple<TensorA, TensorB> const& load_inputs,
                                TensorMaps const& tensormaps, BlockCoord const& blk_coord,
                                KTileIterator& k_tile_iter, int k_tile_count,
                                TensorStorage& shared_tensors) {
    using namespace cute;
    using X = Underscore;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                            typename Base::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()),
                            typename Base::SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    auto tma_a = params.tma_load_a.get_slice(0);
    auto tma_b = params.tma_load_b.get_slice(0);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tAsA = tma_a.partition_D(sA);
    Tensor tBgB = tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tBsB = tma_b.partition_D(sB);
    // The second pair: A2 from the group's first row, B2 at its expert; each
    // pair counts its own K steps from 0.
    Tensor mA2 = domain_offset(make_coord(group_.ext_row, 0, 0),
                               tma_a2.get_tma_tensor(make_shape(ext.rows, ext.k_ext, 1)));
    Tensor gA2 = local_tile(mA2, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});
    Tensor mB2 = tma_b2.get_tma_tensor(make_shape(ext.n, ext.k_ext, ext.experts));
    Tensor gB2 = local_tile(mB2, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});
    auto tma_a2_slice = tma_a2.get_slice(0);
    auto tma_b2_slice = tma_b2.get_slice(0);
    Tensor tA2gA2 = tma_a2_slice.partition_S(gA2(_, _, m_coord, _, 0));
    Tensor tB2gB2 = tma_b2_slice.partition_S(gB2(_, _, n_coord, _, group_.ext_expert));
    const int base_tiles = (group_.k + kBlkK - 1) / kBlkK;
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
        copy(tma_a2.with(*barrier, 0), tA2gA2(_, _, _, k - base_tiles), tAsA(_, _, _, stage));
        copy(tma_b2.with(*barrier, 0), tB2gB2(_, _, _, k - base_tiles), tBsB(_, _, _, stage));
      }
    }
  }

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
