// expert_matmul: the grouped expert GEMM custom call (CUDA, sm90), host interface.
//
// Custom call "expert_matmul" (registered for CUDA only; the CPU uses
// ragged_dot, see jax_moelora/ops/expert_matmul.py):
//   operands: x [M, K], offsets int32 [E + 1], w0 [E, K, N], w1 [E, K, N],
//             sorted_token_ids int32 [M], row_adapter int32 [num_tokens] (or [1]),
//             lora_x [num_tokens, K] (read with lora_x_gather, else any array),
//             then two routes, five arrays each (a_pool [P, R, K], b_pool [P, N, R],
//             a_table int32 [L, E_t], b_table int32 [L, E_t], scale_table f32 [L, E_t]);
//             an absent route is any arrays of the right dtypes (not read);
//             then per route its packs (read with lora_packed): b_ext
//             [n_experts, L * R, N] in x's dtype and marks int32
//             [L * n_experts + 1] (lora_ext.cu's layout, made by
//             pack_lora_in_gemm), any arrays of the right dtypes otherwise.
//   results:  out [num_weights, M, N] (weight set i's output is plane i: gate
//             and up land stacked, the layout the stacked fold reads),
//             scratch u8 [expert_matmul_scratch_bytes(num_weights * E, sm_count)]
//             (with lora_in_gemm and without lora_packed, then per route
//             with LoRA its packed B, [min(n_experts, E), L * R, N], and its
//             marks, each from a multiple of kExpertMatmulScratchAlign),
//             xa [M, R] (the fold's scratch; R the larger route rank, or 1), or
//             with lora_in_gemm [num_weights, M, X], X >= every route's L * R:
//             weight set i's plane holds, in rows L * R wide from its start,
//             each folding row's round(x A^T) in the R columns of its table
//             row and zeros elsewhere (lora_ext.cu; the backward reads it).
//   attrs:    num_weights (1 or 2), has_lora0, has_lora1, has_row_adapter, sm_count,
//             pdl (the fold's expand may use programmatic dependent launch),
//             schedule (ExpertMatmulSchedule: the CUTLASS kernel schedule),
//             lora_in_gemm (1: the fold inside the GEMM's K loop, lora_ext.cu
//             and lora_k_mainloop.cuh; 0: the grouped fold after the GEMM),
//             lora_packed (1, with lora_in_gemm: every route's packed B
//             and marks are the operands, not made in the call),
//             lora_x_gather (1: the folds' shrinks read row r of x as
//             lora_x[sorted_token_ids[r]], which the caller guarantees holds
//             the same values, so that top_k rows share one token row in L2).
//   offsets:  offsets[0] = 0, non-decreasing, offsets[E] <= M (traced jnp builds
//             them from group_sizes). Row r in [offsets[e], offsets[e+1]) is
//             round(x[r] @ w[e]); rows r >= offsets[E] are zero. Then each
//             weight set with a route is folded by the grouped fold with
//             x_gather = 0 (row r reads x[r], its token sorted_token_ids[r];
//             with lora_x_gather the same values from lora_x);
//             with lora_in_gemm an adapted row is instead
//             round(x[r] @ w[e] + round(x[r] A^T) @ round(scale B^T)).
// x, w, pools and outputs share one dtype: bf16 or f16; K and N are multiples
// of kExpertMatmulAlign.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_common.cuh"

namespace moelora {

// One grouped GEMM launch: num_weights * E problems sharing x and offsets.
struct ExpertGemmArgs {
  const void* x;                                // [M, K]
  const void* w[kExpertMatmulMaxWeights];       // [E, K, N] each
  void* out[kExpertMatmulMaxWeights];           // [M, N] each
  const int32_t* offsets;                       // [E + 1]
  int64_t num_weights, E, M, K, N;
  void* scratch;                                // the kernel's scratch_bytes(...) bytes
  int64_t scratch_bytes;
  int sm_count;
  // The LoRA delta inside the K loop (the *Lora kernels), per weight set;
  // xa_ext[i] == nullptr: weight set i has none. Row r of weight set i is
  // round(x[r] @ w[e] + xa_ext[i][r] @ b_ext[i][e]) for e < ext_experts[i].
  const void* xa_ext[kExpertMatmulMaxWeights];  // [M, ext_k]
  const void* b_ext[kExpertMatmulMaxWeights];   // [ext_experts, ext_k, N]
  int64_t ext_k[kExpertMatmulMaxWeights];       // a multiple of kExpertMatmulAlign
  int64_t ext_experts[kExpertMatmulMaxWeights];
};

// A kernel table entry of the library's CUTLASS grouped GEMMs (one per dtype
// and configuration, each in a translation unit of its own):
//   scratch_bytes: bytes of scratch for `num_groups` problems on `sm_count`
//     SMs (pointer/shape/stride arrays, then CUTLASS's workspace);
//   run: writes the problem arrays on the device, zeroes what no problem
//     writes, and runs the CUTLASS grouped GEMM; no host synchronisation, no
//     allocation.
template <class Args>
struct GemmKernel {
  int64_t (*scratch_bytes)(int64_t num_groups, int sm_count);
  cudaError_t (*run)(const Args& args, cudaStream_t stream);
};

// expert_matmul's kernels, per dtype and schedule (expert_matmul_<dtype>_<schedule>.cu;
// the rows past offsets[E] are the ones zeroed), and the same with the LoRA
// delta in the K loop (expert_matmul_<dtype>_<schedule>_lora.cu; they read
// the xa_ext/b_ext fields, the others ignore them).
using ExpertGemmKernel = GemmKernel<ExpertGemmArgs>;
extern const ExpertGemmKernel kExpertGemmBf16Cooperative, kExpertGemmBf16Pingpong,
    kExpertGemmF16Cooperative, kExpertGemmF16Pingpong;
extern const ExpertGemmKernel kExpertGemmBf16CooperativeLora, kExpertGemmBf16PingpongLora,
    kExpertGemmF16CooperativeLora, kExpertGemmF16PingpongLora;

// The *Lora kernels' second operand pair for one weight set and its route
// (lora_ext.cu). pack_lora_ext, for n_sets weight sets at once (folds[s],
// b_ext[s], marks[s]; one N, te and dtype), zeroes `marks` ([L * n_experts +
// 1] int32), then packs every b_ext [min(n_experts, num_experts), L * R, N]
// in one launch, marking the pairs whose packed B is not finite (a caller
// holding packs made beforehand skips it). shrink_lora_ext then writes
// fold.xa (xa_ext [te, L * R], fold.xa_ld = L * R and fold.xa_by_adapter, the
// window all of te) whole: the fast grouped fold's shrink (and, with
// fold.xa2, a second route's into its xa_ext in the same pass), zeros
// elsewhere, leaving out the cells that fold.skip_cells (the marks) mark.
// After the GEMM, fold_marked_rows (one launch for n_sets weight sets) folds
// the rows of the pairs each fold.skip_cells marks into its output as the
// fold after the GEMM does and writes their xa_ext rows (nothing when none is
// marked). The caller checks fast::grouped_split_fits(fold).
cudaError_t pack_lora_ext(const GroupedArgs* folds, void* const* b_ext, int32_t* const* marks,
                          int n_sets, cudaStream_t stream);
cudaError_t shrink_lora_ext(const GroupedArgs& fold, cudaStream_t stream);
cudaError_t fold_marked_rows(const GroupedArgs* folds, int n_sets, cudaStream_t stream);

}  // namespace moelora
