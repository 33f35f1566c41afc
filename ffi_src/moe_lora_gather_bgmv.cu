// moe_lora_gather_bgmv for CUDA: the simple kernels and the FFI handler.
//
// Simple geometry (docs/semantics.md §4): per fold two kernels of 256-thread blocks,
// each block computing 4 outputs of one flat row, 64 threads per output.
//   shrink: grid (ceil(R / 4), n_slots, 1), xa[row, j] = round(x[x_row] . A[j])
//   expand: grid (ceil(N / 4), n_slots, 1), out[row, n] = round(out + s * round(xa . B[n]))
// xa is the kept rows (GatherArgs::kept_xa) when the call keeps them, else
// the scratch.
// Rows are read unsorted; the expert comes from indices[row], the adapter
// from row_adapter[row / top_k]; skip rules from fold_common.h. Under f32
// pools x may be bf16 or f16, widened as the shrink reads it.
#include <algorithm>

#include "cuda_common.cuh"
#include "fold_ffi.h"
#include "moelora_handlers.h"

namespace ffi = xla::ffi;

namespace moelora {
namespace {

constexpr int64_t kMaxGridY = 65535;

struct GatherRow {
  Pair pair;
  int64_t token, expert;
};

__device__ __forceinline__ bool gather_row(const GatherArgs& a, int64_t row, GatherRow* out) {
  out->token = row / a.top_k;
  out->expert = a.indices[row];
  const int64_t adapter = a.has_row_adapter ? a.row_adapter[out->token] : 0;
  return resolve_pair(a.route, adapter, out->expert, &out->pair);
}

// x in DX's dtype: D's, or bf16/f16 widened under f32 pools.
template <DType D, DType DX>
__global__ void __launch_bounds__(kGbgmvThreads)
    gather_shrink_simple(GatherArgs a, int64_t row_base) {
  using Tr = Traits<D>;
  using T = typename Tr::T;
  using Tx = Traits<DX>;
  const int64_t row = row_base + blockIdx.y;
  GatherRow g;
  if (!gather_row(a, row, &g)) return;  // uniform over the block
  const int lane = threadIdx.x % kGbgmvThreadsPerOutput;
  const int64_t j = int64_t(blockIdx.x) * kGbgmvNPerBlock + threadIdx.x / kGbgmvThreadsPerOutput;
  float acc = 0.f;
  if (j < a.R) {
    const typename Tx::T* x = a.x_row<typename Tx::T>(row, g.expert);
    const T* w = static_cast<const T*>(a.a_pool) + (int64_t(g.pair.a) * a.R + j) * a.K;
    for (int64_t k = lane; k < a.K; k += kGbgmvThreadsPerOutput)
      acc += Tx::to_f(x[k]) * Tr::to_f(w[k]);
  }
  const float s = block_output_group_sum(acc);
  if (j < a.R && lane == 0) static_cast<T*>(a.xa_rows())[row * a.R + j] = Tr::from_f(s);
}

template <DType D>
__global__ void __launch_bounds__(kGbgmvThreads)
    gather_expand_simple(GatherArgs a, int64_t row_base) {
  using Tr = Traits<D>;
  using T = typename Tr::T;
  const int64_t row = row_base + blockIdx.y;
  GatherRow g;
  if (!gather_row(a, row, &g)) return;
  const int lane = threadIdx.x % kGbgmvThreadsPerOutput;
  const int64_t n = int64_t(blockIdx.x) * kGbgmvNPerBlock + threadIdx.x / kGbgmvThreadsPerOutput;
  float acc = 0.f;
  if (n < a.N) {
    const T* xa = static_cast<const T*>(a.xa_rows()) + row * a.R;
    const T* w = static_cast<const T*>(a.b_pool) + (int64_t(g.pair.b) * a.N + n) * a.R;
    for (int64_t j = lane; j < a.R; j += kGbgmvThreadsPerOutput)
      acc += Tr::to_f(xa[j]) * Tr::to_f(w[j]);
  }
  const float s = block_output_group_sum(acc);
  if (n < a.N && lane == 0) {
    T* o = a.out_row<T>(row, g.expert) + n;
    const float delta = Tr::to_f(Tr::from_f(s));
    *o = Tr::from_f(fold_add(Tr::to_f(*o), g.pair.scale, delta));
  }
}

template <DType D, DType DX = D>
cudaError_t launch_simple(const GatherArgs& a, cudaStream_t stream) {
  const unsigned shrink_x = unsigned((a.R + kGbgmvNPerBlock - 1) / kGbgmvNPerBlock);
  const unsigned expand_x = unsigned((a.N + kGbgmvNPerBlock - 1) / kGbgmvNPerBlock);
  // grid.y is capped at 65535 rows per launch; larger batches take several.
  for (int64_t base = 0; base < a.n_slots; base += kMaxGridY) {
    const unsigned rows = unsigned(std::min<int64_t>(kMaxGridY, a.n_slots - base));
    gather_shrink_simple<D, DX><<<dim3(shrink_x, rows, 1), kGbgmvThreads, 0, stream>>>(a, base);
    gather_expand_simple<D><<<dim3(expand_x, rows, 1), kGbgmvThreads, 0, stream>>>(a, base);
  }
  return cudaPeekAtLastError();
}

ffi::Error GatherBgmvCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer base,
                              ffi::AnyBuffer base2, ffi::Buffer<ffi::S32> indices,
                              ffi::Buffer<ffi::S32> row_adapter, ffi::AnyBuffer a_pool,
                              ffi::AnyBuffer b_pool, ffi::Buffer<ffi::S32> a_table,
                              ffi::Buffer<ffi::S32> b_table, ffi::Buffer<ffi::F32> scale_table,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out2,
                              ffi::Result<ffi::AnyBuffer> xa, int64_t top_k, int64_t x_gather,
                              int64_t has_row_adapter, int64_t dense_tokens,
                              int64_t dense_experts, int64_t pdl, int64_t variant,
                              int64_t keep_xa) {
  Dims d;
  RouteView route;
  int64_t n_slots;
  if (auto e = check_gather(x, base, base2, indices, row_adapter, a_pool, b_pool, a_table,
                            b_table, scale_table, top_k, x_gather, has_row_adapter, dense_tokens,
                            dense_experts, &d, &route, &n_slots);
      e.failure())
    return e;
  if (auto e = check_gather_xa(xa, base.element_type(), n_slots, d.R, keep_xa); e.failure())
    return e;
  DType dtype;
  if (auto e = cuda_dtype(base.element_type(), &dtype); e.failure()) return e;
  // the second buffer is used (and copied) only when a member's rows live there
  const bool two = gather_uses_out2(route.n_experts, dense_tokens, dense_experts);
  // keep_xa: the kept rows first, the kernels' scratch after them
  char* xa_data = static_cast<char*>(xa->untyped_data());
  const size_t kept_bytes = keep_xa ? xa->size_bytes() / 2 : 0;
  DType x_dtype;
  if (auto e = cuda_dtype(x.element_type(), &x_dtype); e.failure()) return e;
  GatherArgs args{dtype,
                  x_dtype,
                  x.untyped_data(),
                  out->untyped_data(),
                  xa_data + kept_bytes,
                  indices.typed_data(),
                  row_adapter.typed_data(),
                  has_row_adapter != 0,
                  a_pool.untyped_data(),
                  b_pool.untyped_data(),
                  route,
                  n_slots,
                  d.K,
                  d.N,
                  d.R,
                  top_k,
                  x_gather,
                  two ? out2->untyped_data() : nullptr,
                  dense_tokens,
                  dense_experts,
                  pdl != 0,
                  keep_xa ? xa_data : nullptr};
  return launch_variant("moe_lora_gather_bgmv", variant, args, launch_gather_simple,
                        launch_gather_fast, base.untyped_data(), base.size_bytes(), true, stream,
                        base2.untyped_data(), args.out2, two ? base2.size_bytes() : 0);
}

}  // namespace

cudaError_t launch_gather_simple(const GatherArgs& a, cudaStream_t stream) {
  if (a.n_slots == 0) return cudaSuccess;
  switch (a.dtype) {
    case DType::kBf16: return launch_simple<DType::kBf16>(a, stream);
    case DType::kF16: return launch_simple<DType::kF16>(a, stream);
    case DType::kF32:
      switch (a.x_dtype) {
        case DType::kBf16: return launch_simple<DType::kF32, DType::kBf16>(a, stream);
        case DType::kF16: return launch_simple<DType::kF32, DType::kF16>(a, stream);
        case DType::kF32: return launch_simple<DType::kF32>(a, stream);
      }
  }
  return cudaErrorInvalidValue;
}

int cuda_compiled_mlg_m_tile() { return kMlgMTile; }

const char* cuda_architectures() {
#ifdef MOELORA_CUDA_ARCHS
  return MOELORA_CUDA_ARCHS;
#else
  return "";
#endif
}

}  // namespace moelora

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeLoraGatherBgmvCuda, moelora::GatherBgmvCudaImpl,
                              moelora::bind_gather(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
