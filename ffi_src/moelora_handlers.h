// The XLA FFI handler symbols of the extension, one per (op, platform).
//
// Both ops take the same trailing operands and attributes:
//
// moe_lora_gather_bgmv
//   operands: x [X, K], base_out [M, N], base2 [M2, N], indices int32 [n_slots],
//             row_adapter int32 [num_tokens] (or [1] when has_row_adapter=0),
//             a_pool [P, R, K], b_pool [P, N, R], a_table int32 [L, E_t],
//             b_table int32 [L, E_t], scale_table f32 [L, E_t]
//   results:  out [M, N] (aliases base_out), out2 [M2, N] (aliases base2),
//             xa [n_slots, R] (scratch), or [2 * n_slots, R] when keep_xa = 1
//   attrs:    top_k, x_gather, has_row_adapter, dense_tokens, dense_experts,
//             pdl, variant, keep_xa (all int64)
//   keep_xa = 1: xa's first n_slots rows receive each folding row's
//   round(x A^T) (row `row` of xa for flat row `row`; the rows that fold
//   nothing are left as they are), the rest is the kernels' scratch. The
//   training forward of expert_matmul keeps them for its backward.
//   X = n_slots when x_gather = 0 (row `row` read), n_slots / top_k when
//   x_gather = 1 (row `row / top_k` read), M when x_gather = 2 (the dense
//   expert layout below, a route of one member: x row e * T + row / top_k
//   for expert e; XLayout in moelora_constants.h). num_tokens = n_slots / top_k.
//   Output layout (fold_common.h, gather_out_row): dense_tokens = 0, flat
//   rows: row `row` folds out row `row` (M = n_slots; base2 unused, [0, N]).
//   dense_tokens = T > 0, the dense expert layout of MoEBlock's decode path
//   (jax_moelora/ops/dense_fold.py): num_tokens = T, and row `row` of
//   (virtual) expert v folds row (v % dense_experts) * T + row / top_k of
//   out (v < dense_experts) or out2 (a StackedRoute's second member);
//   M = dense_experts * T, M2 = M when E_t > dense_experts (else unused);
//   E_t <= 2 * dense_experts. A token's rows must name distinct experts.
//
// moe_lora_grouped_down
//   operands: x [X, K], base_out [M, N], expert_offsets int32 [num_experts+1],
//             sorted_token_ids int32 [te], row_adapter int32 [num_tokens]
//             (or [1]), out_rows int32 [te] (or [1] when has_out_rows=0),
//             then the five route arrays as above
//   results:  out [M, N] (aliases base_out), xa [te, R] (scratch)
//   attrs:    row_offset, row_end, x_gather, has_row_adapter, has_out_rows,
//             pdl, variant (int64)
//   X = te when x_gather = 0 (row r read), else num_tokens (row
//   sorted_token_ids[r] read). Only rows in [row_offset, row_end) fold.
//   Sorted row r reads and writes out row out_rows[r] (has_out_rows = 1;
//   a value outside [0, M) folds nothing; the rows that fold must target
//   distinct rows) or row r (has_out_rows = 0, M = te).
//
// x, base_out, pools and out share one dtype: bf16, f16 or f32; the gather
// fold also takes bf16 or f16 x with f32 pools (and base_out, out, xa),
// widened exactly as it is read: the bits of the same call on x in f32
// (the router's fold over the activations). pdl = 1
// lets a kernel that follows a plan or shrink kernel of the same call start
// under programmatic dependent launch (jax_moelora/ops/launch.py); 0, an
// ordinary launch. Same bits either way.
#pragma once

#include "xla/ffi/api/ffi.h"

extern "C" {
XLA_FFI_Error* MoeLoraGatherBgmvCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeLoraGroupedDownCpu(XLA_FFI_CallFrame* call_frame);
#ifdef MOELORA_WITH_CUDA
XLA_FFI_Error* MoeLoraGatherBgmvCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MoeLoraGroupedDownCuda(XLA_FFI_CallFrame* call_frame);
#endif
#ifdef MOELORA_WITH_EXPERT_MATMUL
// expert_matmul: operands and attributes in ffi_src/expert_matmul/expert_matmul.h.
XLA_FFI_Error* ExpertMatmulCuda(XLA_FFI_CallFrame* call_frame);
// grouped_matmul: operands and attributes in ffi_src/expert_matmul/grouped_matmul.h.
XLA_FFI_Error* GroupedMatmulCuda(XLA_FFI_CallFrame* call_frame);
#endif
}

#ifdef MOELORA_WITH_EXPERT_MATMUL
namespace moelora {
// Bytes of the expert_matmul scratch buffer for `num_groups` GEMM problems
// (weight sets x experts) on a device with `sm_count` SMs.
int64_t expert_matmul_scratch_bytes(int64_t num_groups, int64_t sm_count);
// Bytes of the grouped_matmul scratch buffer of a `mode` call with
// `num_problems` problems (all its sets' groups, or output matrices for the
// kTgmm modes) on `sm_count` SMs.
int64_t grouped_matmul_scratch_bytes(int64_t mode, int64_t num_problems, int64_t sm_count);
// SMs of CUDA device `device` (0 when it cannot be queried).
int64_t cuda_sm_count(int64_t device);
}  // namespace moelora
#endif

#ifdef MOELORA_WITH_CUDA
namespace moelora {
// MLG_M_TILE as the CUDA translation unit was compiled with it.
int cuda_compiled_mlg_m_tile();
// The CUDA architectures the kernels were built for, e.g. "90a".
const char* cuda_architectures();
}  // namespace moelora
#endif
