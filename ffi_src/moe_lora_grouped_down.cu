// moe_lora_grouped_down for CUDA: the simple kernels and the FFI handler.
//
// Simple geometry (docs/semantics.md §4): per fold two kernels of 256-thread blocks
// over the grid (ceil(out / 4), grouped_down_wc(row_offset, row_end), E_t):
// block (x, y, z) computes 4 outputs (64 threads each) for every row of
// window tile y (MLG_M_TILE rows) that expert z owns.
//   shrink: out = R, xa[r, j] = round(x[x_row(r)] . A[j])
//   expand: out = N, out[r, n] = round(out + s * round(xa[r] . B[n]))
// A fold whose expert_offsets are not well formed (offsets_well_formed) folds
// no row: every block returns before its first row. Otherwise a row folds
// only in the block of the expert whose span holds it (find_expert), into
// out row out_rows[r] (grouped_out_row).
#include <algorithm>

#include "cuda_common.cuh"
#include "fold_ffi.h"
#include "moelora_handlers.h"

namespace ffi = xla::ffi;

namespace moelora {
namespace {

constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxGridZ = 65535;

// The rows [*lo, *hi) of window tile `tile` that expert `e`'s span holds.
__device__ __forceinline__ void tile_rows(const GroupedArgs& a, int64_t tile, int64_t e,
                                          int64_t* lo, int64_t* hi) {
  const int64_t start = a.row_offset + tile * kMlgMTile;
  *lo = max(max(start, int64_t(a.expert_offsets[e])), int64_t(0));
  *hi = min(min(start + kMlgMTile, a.row_end), min(int64_t(a.expert_offsets[e + 1]), a.te));
}

// Whether sorted row r (inside expert e's span) folds, and with what: its x
// row, its out row and its pair.
__device__ __forceinline__ bool grouped_row(const GroupedArgs& a, int64_t r, int64_t e,
                                            int64_t* x_row, int64_t* out_row, Pair* pair) {
  if (!grouped_out_row(a.out_rows, a.m, r, out_row)) return false;
  if (find_expert(a.expert_offsets, a.num_experts, r) != e) return false;
  int64_t token, adapter;
  if (!grouped_row_adapter(a.sorted_token_ids, a.row_adapter, a.has_row_adapter, a.num_tokens,
                           a.x_gather, r, &token, &adapter))
    return false;
  *x_row = a.x_gather ? token : r;
  return resolve_pair(a.route, adapter, e, pair);
}

template <DType D>
__global__ void __launch_bounds__(kGbgmvThreads)
    grouped_shrink_simple(GroupedArgs a, int64_t tile_base) {
  using Tr = Traits<D>;
  using T = typename Tr::T;
  if (!offsets_well_formed(a.expert_offsets, a.num_experts, a.te)) return;  // uniform
  const int64_t e = blockIdx.z;
  int64_t lo, hi;
  tile_rows(a, tile_base + blockIdx.y, e, &lo, &hi);
  const int lane = threadIdx.x % kGbgmvThreadsPerOutput;
  const int64_t j = int64_t(blockIdx.x) * kGbgmvNPerBlock + threadIdx.x / kGbgmvThreadsPerOutput;
  for (int64_t r = lo; r < hi; ++r) {
    int64_t x_row, out_row;
    Pair p;
    if (!grouped_row(a, r, e, &x_row, &out_row, &p)) continue;  // uniform over the block
    float acc = 0.f;
    if (j < a.R) {
      const T* x = static_cast<const T*>(a.x) + x_row * a.K;
      const T* w = static_cast<const T*>(a.a_pool) + (int64_t(p.a) * a.R + j) * a.K;
      for (int64_t k = lane; k < a.K; k += kGbgmvThreadsPerOutput)
        acc += Tr::to_f(x[k]) * Tr::to_f(w[k]);
    }
    const float s = block_output_group_sum(acc);
    if (j < a.R && lane == 0) static_cast<T*>(a.xa)[r * a.R + j] = Tr::from_f(s);
  }
}

template <DType D>
__global__ void __launch_bounds__(kGbgmvThreads)
    grouped_expand_simple(GroupedArgs a, int64_t tile_base) {
  using Tr = Traits<D>;
  using T = typename Tr::T;
  if (!offsets_well_formed(a.expert_offsets, a.num_experts, a.te)) return;  // uniform
  const int64_t e = blockIdx.z;
  int64_t lo, hi;
  tile_rows(a, tile_base + blockIdx.y, e, &lo, &hi);
  const int lane = threadIdx.x % kGbgmvThreadsPerOutput;
  const int64_t n = int64_t(blockIdx.x) * kGbgmvNPerBlock + threadIdx.x / kGbgmvThreadsPerOutput;
  for (int64_t r = lo; r < hi; ++r) {
    int64_t x_row, out_row;
    Pair p;
    if (!grouped_row(a, r, e, &x_row, &out_row, &p)) continue;
    float acc = 0.f;
    if (n < a.N) {
      const T* xa = static_cast<const T*>(a.xa) + r * a.R;
      const T* w = static_cast<const T*>(a.b_pool) + (int64_t(p.b) * a.N + n) * a.R;
      for (int64_t j = lane; j < a.R; j += kGbgmvThreadsPerOutput)
        acc += Tr::to_f(xa[j]) * Tr::to_f(w[j]);
    }
    const float s = block_output_group_sum(acc);
    if (n < a.N && lane == 0) {
      T* o = static_cast<T*>(a.out) + out_row * a.N + n;
      const float delta = Tr::to_f(Tr::from_f(s));
      *o = Tr::from_f(fold_add(Tr::to_f(*o), p.scale, delta));
    }
  }
}

// grouped_down_wc of the window: ceil((row_end - row_offset) / MLG_M_TILE), at least 1.
int64_t window_tiles(int64_t row_offset, int64_t row_end) {
  const int64_t rows = std::max<int64_t>(0, row_end - row_offset);
  return std::max<int64_t>(1, (rows + kMlgMTile - 1) / kMlgMTile);
}

template <DType D>
cudaError_t launch_simple(const GroupedArgs& a, cudaStream_t stream) {
  const unsigned shrink_x = unsigned((a.R + kGbgmvNPerBlock - 1) / kGbgmvNPerBlock);
  const unsigned expand_x = unsigned((a.N + kGbgmvNPerBlock - 1) / kGbgmvNPerBlock);
  const int64_t wc = window_tiles(a.row_offset, a.row_end);
  const unsigned experts = unsigned(a.route.n_experts);
  // The shrink of every tile must finish before any expand reads xa: the two
  // launches are ordered on the stream. grid.y is capped at 65535 tiles.
  for (int64_t base = 0; base < wc; base += kMaxGridY) {
    const unsigned tiles = unsigned(std::min<int64_t>(kMaxGridY, wc - base));
    grouped_shrink_simple<D><<<dim3(shrink_x, tiles, experts), kGbgmvThreads, 0, stream>>>(a, base);
    grouped_expand_simple<D><<<dim3(expand_x, tiles, experts), kGbgmvThreads, 0, stream>>>(a, base);
  }
  return cudaPeekAtLastError();
}

ffi::Error GroupedDownCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer base,
                               ffi::Buffer<ffi::S32> expert_offsets,
                               ffi::Buffer<ffi::S32> sorted_token_ids,
                               ffi::Buffer<ffi::S32> row_adapter, ffi::Buffer<ffi::S32> out_rows,
                               ffi::AnyBuffer a_pool, ffi::AnyBuffer b_pool,
                               ffi::Buffer<ffi::S32> a_table, ffi::Buffer<ffi::S32> b_table,
                               ffi::Buffer<ffi::F32> scale_table, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> xa, int64_t row_offset,
                               int64_t row_end, int64_t x_gather, int64_t has_row_adapter,
                               int64_t has_out_rows, int64_t pdl, int64_t variant) {
  Dims d;
  RouteView route;
  if (auto e = check_grouped(x, base, expert_offsets, sorted_token_ids, out_rows, a_pool, b_pool,
                             a_table, b_table, scale_table, x_gather, has_out_rows, &d, &route);
      e.failure())
    return e;
  if (route.n_experts > kMaxGridZ)
    return ffi::Error::InvalidArgument("moe_lora_grouped_down: more than 65535 table experts");
  DType dtype;
  if (auto e = cuda_dtype(base.element_type(), &dtype); e.failure()) return e;
  const int64_t te = int64_t(sorted_token_ids.element_count());
  GroupedArgs args{dtype,
                   x.untyped_data(),
                   out->untyped_data(),
                   xa->untyped_data(),
                   expert_offsets.typed_data(),
                   sorted_token_ids.typed_data(),
                   row_adapter.typed_data(),
                   has_row_adapter != 0,
                   x_gather ? x.dimensions()[0]
                            : (has_row_adapter ? int64_t(row_adapter.element_count()) : 0),
                   a_pool.untyped_data(),
                   b_pool.untyped_data(),
                   route,
                   int64_t(expert_offsets.element_count()) - 1,
                   te,
                   d.K,
                   d.N,
                   d.R,
                   std::max<int64_t>(0, row_offset),
                   std::min<int64_t>(te, row_end),
                   x_gather != 0,
                   has_out_rows ? out_rows.typed_data() : nullptr,
                   base.dimensions()[0],
                   pdl != 0};
  return launch_variant("moe_lora_grouped_down", variant, args, launch_grouped_simple,
                        launch_grouped_fast, base.untyped_data(), base.size_bytes(),
                        args.row_offset < args.row_end, stream);
}

}  // namespace

cudaError_t launch_grouped_simple(const GroupedArgs& a, cudaStream_t stream) {
  switch (a.dtype) {
    case DType::kBf16: return launch_simple<DType::kBf16>(a, stream);
    case DType::kF16: return launch_simple<DType::kF16>(a, stream);
    case DType::kF32: return launch_simple<DType::kF32>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moelora

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeLoraGroupedDownCuda, moelora::GroupedDownCudaImpl,
                              moelora::bind_grouped(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
