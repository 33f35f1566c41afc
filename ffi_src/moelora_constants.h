// The one place for every constant shared by the C++/CUDA handlers and Python.
// Python reads them from the built extension (jax_moelora._moelora), never
// from a copy: see jax_moelora/geometry.py.
#pragma once

#include <cstdint>

namespace moelora {

// Rows per grouped-fold tile of the simple kernels (docs/semantics.md §4).
inline constexpr int kMlgMTile = 64;
// Simple gather geometry: 256-thread blocks computing 4 outputs, 64 threads each.
inline constexpr int kGbgmvThreads = 256;
inline constexpr int kGbgmvNPerBlock = 4;
inline constexpr int kGbgmvThreadsPerOutput = kGbgmvThreads / kGbgmvNPerBlock;
// LoRA ranks are padded to a multiple of this (16-byte rows in bf16).
inline constexpr int kRankAlign = 8;
// Largest padded rank the kernels accept (shared-memory xa buffers).
inline constexpr int kMaxRank = 256;

// Value of the `variant` attribute of both custom calls.
enum Variant : int64_t {
  kVariantSimple = 0,  // simple geometry: shrink into xa, then expand-and-fold
  kVariantFast = 1,  // tuned kernels
};

// Values of the gather fold's `x_gather` attribute: the x row that flat row
// `row` (token row / top_k, expert e) reads.
enum XLayout : int64_t {
  kXRows = 0,    // x [n_slots, K]: row `row`
  kXTokens = 1,  // x [n_slots / top_k, K]: row `row / top_k`
  kXDense = 2,   // x [dense_experts * dense_tokens, K], the dense expert layout
                 // of the output: row e * dense_tokens + row / top_k
};

// FFI target names: one per op, registered for "cpu" and "CUDA".
inline constexpr const char* kGatherBgmvTarget = "moe_lora_gather_bgmv";
inline constexpr const char* kGroupedDownTarget = "moe_lora_grouped_down";

// expert_matmul (ffi_src/expert_matmul/): the grouped expert GEMM custom call,
// registered for CUDA when the CUTLASS headers were found at build time.
inline constexpr const char* kExpertMatmulTarget = "expert_matmul";
// K and N must be multiples of this many elements (16-byte rows for TMA).
inline constexpr int kExpertMatmulAlign = 8;
// Byte alignment of each array carved out of the custom call's scratch buffer.
inline constexpr int64_t kExpertMatmulScratchAlign = 256;
// `bytes` rounded up to kExpertMatmulScratchAlign.
inline constexpr int64_t expert_matmul_scratch_align(int64_t bytes) {
  return (bytes + kExpertMatmulScratchAlign - 1) / kExpertMatmulScratchAlign *
         kExpertMatmulScratchAlign;
}
// Scratch of one route folded inside expert_matmul's GEMM (lora_ext.cu),
// after the GEMM's own: the packed B [min(n_experts, E), L * R, N] (2-byte
// elements), then the marks of the pairs whose packed B is not finite
// ([L * n_experts] int32 and one more, set when any is), each rounded up to
// kExpertMatmulScratchAlign.
inline constexpr int64_t lora_ext_packed_b_bytes(int64_t L, int64_t n_experts, int64_t E,
                                                 int64_t R, int64_t N) {
  return expert_matmul_scratch_align((n_experts < E ? n_experts : E) * L * R * N * 2);
}
inline constexpr int64_t lora_ext_scratch_bytes(int64_t L, int64_t n_experts, int64_t E,
                                                int64_t R, int64_t N) {
  return lora_ext_packed_b_bytes(L, n_experts, E, R, N) +
         expert_matmul_scratch_align((L * n_experts + 1) * 4);
}
// Weight sets one call multiplies with the same rows (gate and up).
inline constexpr int kExpertMatmulMaxWeights = 2;
// Values of expert_matmul's `schedule` attribute: the CUTLASS kernel schedule
// (ffi_src/expert_matmul/expert_matmul_config.cuh).
enum ExpertMatmulSchedule : int64_t {
  kExpertMatmulCooperative = 0,  // two warpgroups on one tile
  kExpertMatmulPingpong = 1,     // a tile per warpgroup, epilogues overlapped
};

// grouped_matmul (ffi_src/expert_matmul/grouped_matmul.h): grouped GEMMs over
// row groups of several independent operand sets in one launch, the
// building block of the backward passes (jax_moelora/ops/grouped_matmul.py).
inline constexpr const char* kGroupedMatmulTarget = "grouped_matmul";
// Operand sets one grouped_matmul call takes.
inline constexpr int kGroupedMatmulMaxSets = 8;
// Values of grouped_matmul's `mode` attribute.
enum GroupedMatmulMode : int64_t {
  kGmm = 0,      // out[r] = lhs[r] @ rhs[slot(g)]      rhs [P, K, N], out [M, N]
  kGmmRhsT = 1,  // out[r] = lhs[r] @ rhs[slot(g)]^T    rhs [P, N, K], out [M, N]
  kTgmm = 2,     // out[q] = lhs[rows of g(q)]^T @ rhs[rows of g(q)]   out f32 [Q, K, N]
  kTgmmRounded = 3,  // kTgmm's fp32 sums rounded once to lhs' dtype   out [Q, K, N]
};

}  // namespace moelora
