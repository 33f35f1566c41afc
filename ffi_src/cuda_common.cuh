// CUDA helpers shared by the seed and fast kernels: dtype traits (fp32
// accumulation, round-to-nearest-even to the activation dtype) and the
// launch-argument structs the handlers hand to the kernel launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fold_common.h"

namespace moelora {

enum class DType : int { kBf16 = 0, kF16 = 1, kF32 = 2 };

template <DType D> struct Traits;
template <> struct Traits<DType::kBf16> {
  using T = __nv_bfloat16;
  static __device__ __forceinline__ float to_f(T v) { return __bfloat162float(v); }
  static __device__ __forceinline__ T from_f(float f) { return __float2bfloat16_rn(f); }
};
template <> struct Traits<DType::kF16> {
  using T = __half;
  static __device__ __forceinline__ float to_f(T v) { return __half2float(v); }
  static __device__ __forceinline__ T from_f(float f) { return __float2half_rn(f); }
};
template <> struct Traits<DType::kF32> {
  using T = float;
  static __device__ __forceinline__ float to_f(T v) { return v; }
  static __device__ __forceinline__ T from_f(float f) { return f; }
};

// out = round(float(out) + scale * float(delta)), with the product rounded
// to fp32 before the add (no fused multiply-add), as the CPU handlers do.
__device__ __forceinline__ float fold_add(float out, float scale, float delta) {
  return __fadd_rn(out, __fmul_rn(scale, delta));
}

// Everything a gather fold launch needs (device pointers; shapes as int64).
struct GatherArgs {
  DType dtype;
  const void* x;            // [x_gather ? n_slots / top_k : n_slots, K]
  void* out;                // [n_slots, N], already holds base_out
  void* xa;                 // [n_slots, R] scratch (activation dtype)
  const int32_t* indices;   // [n_slots]
  const int32_t* row_adapter;  // [n_slots / top_k] when has_row_adapter
  bool has_row_adapter;
  const void* a_pool;       // [P, R, K]
  const void* b_pool;       // [P, N, R]
  RouteView route;
  int64_t n_slots, K, N, R, top_k;
  bool x_gather;
};

// Everything a grouped fold launch needs.
struct GroupedArgs {
  DType dtype;
  const void* x;            // [x_gather ? num_x_rows : te, K]
  void* out;                // [te, N], already holds base_out
  void* xa;                 // [te, R] scratch
  const int32_t* expert_offsets;    // [num_experts + 1]
  const int32_t* sorted_token_ids;  // [te]
  const int32_t* row_adapter;       // [num_ra] when has_row_adapter
  bool has_row_adapter;
  int64_t num_tokens;  // bound on sorted_token_ids values: x rows (x_gather) or num_ra
  const void* a_pool;
  const void* b_pool;
  RouteView route;
  int64_t num_experts, te, K, N, R, row_offset, row_end;
  bool x_gather;
};

// The tuned kernels (moe_lora_fast.cu). They fold exactly like the seed
// kernels (same skip rules, same roundings; summation order may differ).
cudaError_t launch_gather_fast(const GatherArgs& args, cudaStream_t stream);
cudaError_t launch_grouped_fast(const GroupedArgs& args, cudaStream_t stream);

}  // namespace moelora
