// CUDA helpers shared by the simple and fast kernels: dtype traits (fp32
// accumulation, round-to-nearest-even to the activation dtype) and the
// launch-argument structs the handlers hand to the kernel launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "fold_common.h"
#include "xla/ffi/api/ffi.h"

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

// Sums of N values (N a power of two, at most 32) over the 32 lanes of a
// warp by a fixed butterfly (xor 16, 8, 4, 2, 1), with N - 1 + 5 - log2(N)
// shuffles instead of 5 per value: at each of the first log2(N) steps a lane
// keeps half of its values (the upper half where its lane bit is set) and
// adds the partner's copy of that half, so each pair of lanes sums each
// value once; the remaining steps add the one value left. Lane l returns the
// sum of value l / (32 / N). Each value is summed in the tree of a one-value
// butterfly (the same pairs at the same steps, and a + b == b + a), so it
// gets warp_sum's bits whatever N.
template <int N, int O = 16>
__device__ __forceinline__ float warp_sum_split(float (&v)[N]) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N a power of two <= 32");
  if constexpr (N == 1) {
    float s = v[0];
#pragma unroll
    for (int o = O; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
  } else {
    const bool upper = threadIdx.x & O;
    float h[N / 2];
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float lo = v[j], hi = v[j + N / 2];
      h[j] = (upper ? hi : lo) + __shfl_xor_sync(0xffffffffu, upper ? lo : hi, O);
    }
    return warp_sum_split<N / 2, O / 2>(h);
  }
}

// Sum of `v` over the 32 lanes of a warp (every lane gets the same bits).
__device__ __forceinline__ float warp_sum(float v) {
  float one[1] = {v};
  return warp_sum_split<1>(one);
}

// The warp's sums of v[0 .. N) (warp_sum_split) stored to dst[0 .. N), each
// by the first lane that holds it.
template <int N>
__device__ __forceinline__ void store_warp_sums(float (&v)[N], float* dst) {
  constexpr int kLanes = 32 / N;  // lanes holding each value's sum
  const int lane = threadIdx.x & 31;
  const float s = warp_sum_split<N>(v);
  if (lane % kLanes == 0) dst[lane / kLanes] = s;
}

// Sum of `v` over each group of kGbgmvThreadsPerOutput consecutive threads of
// a kGbgmvThreads block (the simple kernels' one-output-per-64-threads layout).
// Every thread of the block must call it (it synchronises the block).
__device__ __forceinline__ float block_output_group_sum(float v) {
  constexpr int kWarps = kGbgmvThreads / 32;
  constexpr int kWarpsPerGroup = kGbgmvThreadsPerOutput / 32;
  __shared__ float partial[kWarps];
  v = warp_sum(v);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) partial[warp] = v;
  __syncthreads();
  const int group = threadIdx.x / kGbgmvThreadsPerOutput;
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarpsPerGroup; ++w) s += partial[group * kWarpsPerGroup + w];
  __syncthreads();  // partial[] is reused by the next call
  return s;
}

// Everything a gather fold launch needs (device pointers; shapes as int64).
struct GatherArgs {
  DType dtype;
  DType x_dtype;            // dtype, or bf16/f16 under f32 pools (read widened)
  const void* x;            // x_gather's (XLayout) rows, [*, K]
  void* out;                // [n_slots, N], already holds base_out
  void* xa;                 // [n_slots, R] scratch (activation dtype)
  const int32_t* indices;   // [n_slots]
  const int32_t* row_adapter;  // [n_slots / top_k] when has_row_adapter
  bool has_row_adapter;
  const void* a_pool;       // [P, R, K]
  const void* b_pool;       // [P, N, R]
  RouteView route;
  int64_t n_slots, K, N, R, top_k;
  int64_t x_gather;  // XLayout: the x row a flat row reads (x_row)
  // Output layout (fold_common.h's gather_out_row): dense_tokens == 0, flat
  // rows of out; else a (virtual) expert's rows live in out (member 0) or
  // out2 (member 1), [dense_experts, dense_tokens, N] each.
  void* out2;
  int64_t dense_tokens, dense_experts;
  bool pdl;  // kernels after a plan kernel may use programmatic dependent launch
  // keep_xa: [n_slots, R], each folding row's round(x A^T) written here (row
  // `row` at row * R); null otherwise. xa is then the scratch after it.
  void* kept_xa;

  // Where the simple kernels put a row's xa: the kept rows, else the scratch.
  __host__ __device__ __forceinline__ void* xa_rows() const { return kept_xa ? kept_xa : xa; }

  // Flat row `row`'s kept xa (element type T), or null when the call keeps none.
  template <class T>
  __host__ __device__ __forceinline__ T* kept_row(int64_t row) const {
    return kept_xa ? static_cast<T*>(kept_xa) + row * R : nullptr;
  }

  // The first element of the output row of flat row `row` folding with
  // (virtual) expert `expert` (element type T). The flat layout returns
  // before the token is computed: a 64-bit division there cost the router's
  // f32 kernel a third of its registers and 40 % of its time.
  template <class T>
  __host__ __device__ __forceinline__ T* out_row(int64_t row, int64_t expert) const {
    if (dense_tokens == 0) return static_cast<T*>(out) + row * N;
    int buffer;
    const int64_t o = gather_out_row(row, row / top_k, expert, dense_tokens, dense_experts, &buffer);
    return static_cast<T*>(buffer ? out2 : out) + o * N;
  }

  // The first element of the x row that flat row `row` folding with
  // (member-0) expert `expert` reads (fold_common.h's gather_x_row).
  template <class T>
  __host__ __device__ __forceinline__ const T* x_row(int64_t row, int64_t expert) const {
    return static_cast<const T*>(x) + gather_x_row(x_gather, row, top_k, expert, dense_tokens) * K;
  }
};

// Everything a grouped fold launch needs. Sorted row r reads and writes out
// row out_rows[r] (grouped_out_row: nullptr is the identity; a row outside
// [0, m) folds nothing).
struct GroupedArgs {
  DType dtype;
  const void* x;            // [x_gather ? num_x_rows : te, K]
  void* out;                // [m, N], already holds base_out
  void* xa;                 // [te, xa_ld] scratch, by sorted row
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
  const int32_t* out_rows;  // [te], or nullptr (out row r for sorted row r)
  int64_t m;                // rows of out (te when out_rows is nullptr)
  bool pdl;  // the expand may use programmatic dependent launch after the shrink
  // xa's row stride (0: R) and whether a row's shrink lands in the R columns
  // of its table row (column l * R, the LoRA inside expert_matmul's GEMM)
  // rather than in columns [0, R).
  int64_t xa_ld = 0;
  bool xa_by_adapter = false;
  // The shrink alone (launch_grouped_shrink), xa_by_adapter: a second route
  // of the same num_loras, n_experts and R (a_pool2, route2) whose xa goes
  // to xa2 (same layout), computed in the same pass over x; xa2 == nullptr:
  // none.
  const void* a_pool2 = nullptr;
  RouteView route2 = {};
  void* xa2 = nullptr;
  // The shrink alone: cells (l * n_experts + e) of route (skip_cells) and
  // route2 (skip_cells2) whose nonzero entry leaves their rows out of xa, or
  // nullptr: none (expert_matmul folds those rows after its GEMM, lora_ext.cu).
  const int32_t* skip_cells = nullptr;
  const int32_t* skip_cells2 = nullptr;
};

// The simple kernels (moe_lora_gather_bgmv.cu, moe_lora_grouped_down.cu):
// two launches each, shrink into xa then expand-and-fold.
cudaError_t launch_gather_simple(const GatherArgs& args, cudaStream_t stream);
cudaError_t launch_grouped_simple(const GroupedArgs& args, cudaStream_t stream);

// The kernels' dtype of an FFI element type (bf16, f16 or f32).
inline xla::ffi::Error cuda_dtype(xla::ffi::DataType t, DType* out) {
  switch (t) {
    case xla::ffi::DataType::BF16: *out = DType::kBf16; return xla::ffi::Error::Success();
    case xla::ffi::DataType::F16: *out = DType::kF16; return xla::ffi::Error::Success();
    case xla::ffi::DataType::F32: *out = DType::kF32; return xla::ffi::Error::Success();
    default: return xla::ffi::Error::InvalidArgument("moe_lora fold: dtype must be bf16, f16 or f32");
  }
}

// The tuned kernels (ffi_src/fast/). They fold exactly like the simple
// kernels (same skip rules, same roundings; summation order may differ).
cudaError_t launch_gather_fast(const GatherArgs& args, cudaStream_t stream);
cudaError_t launch_grouped_fast(const GroupedArgs& args, cudaStream_t stream);

// The tail of both CUDA handlers: copy base_out into out (and a gather
// fold's second base into out2) when XLA did not alias them, launch
// `variant` (when `launch`: the window holds rows), and turn a CUDA error
// into an FFI error naming `op`.
template <class Args>
xla::ffi::Error launch_variant(const char* op, int64_t variant, const Args& args,
                               cudaError_t (*simple)(const Args&, cudaStream_t),
                               cudaError_t (*fast)(const Args&, cudaStream_t), const void* base,
                               size_t bytes, bool launch, cudaStream_t stream,
                               const void* base2 = nullptr, void* out2 = nullptr,
                               size_t bytes2 = 0) {
  if (variant != kVariantSimple && variant != kVariantFast)
    return xla::ffi::Error::InvalidArgument(std::string(op) + ": unknown variant");
  cudaError_t err = cudaSuccess;
  if (base != args.out)
    err = cudaMemcpyAsync(args.out, base, bytes, cudaMemcpyDeviceToDevice, stream);
  if (err == cudaSuccess && bytes2 && base2 != out2)
    err = cudaMemcpyAsync(out2, base2, bytes2, cudaMemcpyDeviceToDevice, stream);
  if (err == cudaSuccess && launch) err = (variant == kVariantSimple ? simple : fast)(args, stream);
  if (err != cudaSuccess)
    return xla::ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(err));
  return xla::ffi::Error::Success();
}

}  // namespace moelora
