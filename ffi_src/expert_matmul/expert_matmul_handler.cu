// The CUDA FFI handler of expert_matmul (operands in expert_matmul.h): the
// CUTLASS grouped GEMM of every weight set and, for each weight set with a
// route, the fast grouped fold, in one of two places (the lora_in_gemm
// attribute): after the GEMM, a second pass over its output; or inside the
// GEMM's K loop (lora_k_mainloop.cuh), after a shrink and a pack of B
// (lora_ext.cu; with the lora_packed attribute the packs are operands, made
// once per adapter change), the output written once (but for the rows of
// pairs whose packed B is not finite, which lora_ext.cu folds after the GEMM).
#include <algorithm>
#include <initializer_list>
#include <string>

#include "expert_matmul.h"
#include "fast/fast_common.cuh"
#include "fold_ffi.h"
#include "moelora_handlers.h"

namespace ffi = xla::ffi;

namespace moelora {
namespace {

ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("expert_matmul: " + what);
}

// The CUTLASS kernel of a dtype and schedule, with the LoRA in its K loop or
// not; nullptr for an unknown schedule.
const ExpertGemmKernel* gemm_kernel(DType dtype, int64_t schedule, bool lora) {
  const bool bf16 = dtype == DType::kBf16;
  switch (schedule) {
    case kExpertMatmulCooperative:
      if (lora) return bf16 ? &kExpertGemmBf16CooperativeLora : &kExpertGemmF16CooperativeLora;
      return bf16 ? &kExpertGemmBf16Cooperative : &kExpertGemmF16Cooperative;
    case kExpertMatmulPingpong:
      if (lora) return bf16 ? &kExpertGemmBf16PingpongLora : &kExpertGemmF16PingpongLora;
      return bf16 ? &kExpertGemmBf16Pingpong : &kExpertGemmF16Pingpong;
    default:
      return nullptr;
  }
}

constexpr const ExpertGemmKernel* kAllKernels[] = {
    &kExpertGemmBf16Cooperative,     &kExpertGemmBf16Pingpong,     &kExpertGemmF16Cooperative,
    &kExpertGemmF16Pingpong,         &kExpertGemmBf16CooperativeLora, &kExpertGemmBf16PingpongLora,
    &kExpertGemmF16CooperativeLora,  &kExpertGemmF16PingpongLora};

struct RouteBuffers {
  ffi::AnyBuffer a_pool, b_pool;
  ffi::Buffer<ffi::S32> a_table, b_table;
  ffi::Buffer<ffi::F32> scale_table;
  ffi::AnyBuffer b_ext;          // the packs made beforehand (lora_packed)
  ffi::Buffer<ffi::S32> marks;
};

// A route's packs made beforehand: b_ext [n_experts, L * R, N] in dtype dt,
// marks [L * n_experts + 1] (lora_ext.cu's layout).
bool packs_fit(const RouteBuffers& rb, const RouteView& route, int64_t R, int64_t N,
               ffi::DataType dt) {
  const auto bd = rb.b_ext.dimensions();
  return bd.size() == 3 && bd[0] == route.n_experts && bd[1] == route.num_loras * R &&
         bd[2] == N && rb.b_ext.element_type() == dt &&
         int64_t(rb.marks.element_count()) == route.num_loras * route.n_experts + 1;
}

ffi::Error ExpertMatmulCudaImpl(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> offsets, ffi::AnyBuffer w0,
    ffi::AnyBuffer w1, ffi::Buffer<ffi::S32> sorted_token_ids, ffi::Buffer<ffi::S32> row_adapter,
    ffi::AnyBuffer lora_x, ffi::AnyBuffer a0, ffi::AnyBuffer b0, ffi::Buffer<ffi::S32> at0,
    ffi::Buffer<ffi::S32> bt0, ffi::Buffer<ffi::F32> st0, ffi::AnyBuffer a1, ffi::AnyBuffer b1,
    ffi::Buffer<ffi::S32> at1, ffi::Buffer<ffi::S32> bt1, ffi::Buffer<ffi::F32> st1,
    ffi::AnyBuffer pb0, ffi::Buffer<ffi::S32> pm0, ffi::AnyBuffer pb1, ffi::Buffer<ffi::S32> pm1,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> scratch,
    ffi::Result<ffi::AnyBuffer> xa, int64_t num_weights, int64_t has_lora0, int64_t has_lora1,
    int64_t has_row_adapter, int64_t sm_count, int64_t pdl, int64_t schedule,
    int64_t lora_in_gemm, int64_t lora_packed, int64_t lora_x_gather) {
  const auto xd = x.dimensions(), wd = w0.dimensions();
  if (xd.size() != 2 || wd.size() != 3) return invalid("x must be [M, K] and w [E, K, N]");
  const int64_t M = xd[0], K = xd[1], E = wd[0], N = wd[2];
  if (wd[1] != K) return invalid("x and w disagree on K");
  if (num_weights < 1 || num_weights > kExpertMatmulMaxWeights) return invalid("num_weights");
  if (K % kExpertMatmulAlign || N % kExpertMatmulAlign)
    return invalid("K and N must be multiples of kExpertMatmulAlign");
  if (int64_t(offsets.element_count()) != E + 1) return invalid("offsets must have E + 1 entries");
  if (int64_t(sorted_token_ids.element_count()) != M) return invalid("sorted_token_ids length");
  if (sm_count < 1) return invalid("sm_count");
  const auto dt = x.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) return invalid("dtype must be bf16 or f16");
  ffi::AnyBuffer ws[] = {w0, w1};
  for (int64_t i = 0; i < num_weights; ++i) {
    const auto d = ws[i].dimensions();
    if (d.size() != 3 || d[0] != E || d[1] != K || d[2] != N || ws[i].element_type() != dt)
      return invalid("the weight sets differ in shape or dtype");
  }
  const auto od = out->dimensions();
  if (od.size() != 3 || od[0] != num_weights || od[1] != M || od[2] != N ||
      out->element_type() != dt)
    return invalid("output shape: [num_weights, M, N] in x's dtype");
  // weight set i's output: plane i of out
  char* const out_base = static_cast<char*>(out->untyped_data());
  void* outs[kExpertMatmulMaxWeights] = {};
  for (int64_t i = 0; i < num_weights; ++i) outs[i] = out_base + i * M * N * 2;  // 2-byte elements
  const DType dtype = dt == ffi::DataType::BF16 ? DType::kBf16 : DType::kF16;
  // The folds' shrinks read x[r] or, with lora_x_gather, the same values
  // from the tokens, lora_x[sorted_token_ids[r]]: top_k rows of x share one
  // token row, which stays in L2 between its reads at prefill sizes.
  const bool tokens = lora_x_gather != 0;
  const auto lxd = lora_x.dimensions();
  const int64_t num_ra = has_row_adapter ? int64_t(row_adapter.element_count()) : 0;
  if (tokens && (lxd.size() != 2 || lxd[1] != K || lora_x.element_type() != dt))
    return invalid("lora_x must be [num_tokens, K] in x's dtype");
  if (tokens && has_row_adapter && num_ra != lxd[0])
    return invalid("row_adapter and lora_x disagree on num_tokens");
  const bool in_gemm = lora_in_gemm != 0;
  const ExpertGemmKernel* kernel = gemm_kernel(dtype, schedule, in_gemm);
  if (kernel == nullptr) return invalid("schedule");
  const int64_t groups = num_weights * E;
  const bool packed = in_gemm && lora_packed != 0;
  // The GEMM's scratch (sized for every kernel), then, unless they are
  // operands, the packed B and the marks of each weight set folded inside
  // the GEMM (lora_ext_scratch_bytes).
  int64_t need = expert_matmul_scratch_bytes(groups, sm_count);

  // Routes are checked before anything is launched.
  RouteBuffers rb[] = {{a0, b0, at0, bt0, st0, pb0, pm0}, {a1, b1, at1, bt1, st1, pb1, pm1}};
  const bool has_lora[] = {has_lora0 != 0, has_lora1 != 0};
  RouteView routes[kExpertMatmulMaxWeights];
  Dims dims[kExpertMatmulMaxWeights];
  int64_t b_ext_at[kExpertMatmulMaxWeights] = {}, marks_at[kExpertMatmulMaxWeights] = {};
  const auto xad = xa->dimensions();
  // weight set i's grouped fold over its GEMM output, its shrink into xa_rows
  auto fold_args = [&](int64_t i, void* xa_rows) {
    GroupedArgs f{dtype, tokens ? lora_x.untyped_data() : x.untyped_data(), outs[i], xa_rows,
                  offsets.typed_data(), sorted_token_ids.typed_data(), row_adapter.typed_data(),
                  has_row_adapter != 0, tokens ? lxd[0] : num_ra,
                  rb[i].a_pool.untyped_data(), rb[i].b_pool.untyped_data(), routes[i], E, M, K, N,
                  dims[i].R, 0, M, tokens, nullptr, M, pdl != 0};
    if (in_gemm) {  // xa_rows: weight set i's plane of xa_ext
      f.xa_ld = routes[i].num_loras * dims[i].R;
      f.xa_by_adapter = true;
    }
    return f;
  };
  auto xa_plane = [&](int64_t i) {
    return static_cast<void*>(static_cast<char*>(xa->untyped_data()) + i * M * xad[2] * 2);
  };
  for (int64_t i = 0; i < num_weights; ++i) {
    if (!has_lora[i]) continue;
    if (auto e = check_route_for(x, N, dt, rb[i].a_pool, rb[i].b_pool, rb[i].a_table,
                                 rb[i].b_table, rb[i].scale_table, &dims[i], &routes[i]);
        e.failure())
      return e;
    if (routes[i].n_experts > E) return invalid("a route has more experts than w");
    if (!in_gemm) {
      if (xad.size() != 2 || xad[0] != M || xad[1] < dims[i].R) return invalid("xa scratch shape");
      continue;
    }
    const int64_t ext_k = routes[i].num_loras * dims[i].R;
    if (xad.size() != 3 || xad[0] != num_weights || xad[1] != M || xad[2] < ext_k)
      return invalid("xa scratch shape: [num_weights, M, >= L * R] with lora_in_gemm");
    if (!fast::grouped_split_fits(fold_args(i, xa_plane(i))))
      return invalid("lora_in_gemm: the route's shapes do not fit the shrink");
    if (packed) {
      if (!packs_fit(rb[i], routes[i], dims[i].R, N, dt))
        return invalid("lora_packed: a route's packs must be b_ext [n_experts, L * R, N] in x's "
                       "dtype and marks int32 [L * n_experts + 1]");
      continue;
    }
    const int64_t L = routes[i].num_loras, Et = routes[i].n_experts;
    b_ext_at[i] = need;
    marks_at[i] = need + lora_ext_packed_b_bytes(L, Et, E, dims[i].R, N);
    need += lora_ext_scratch_bytes(L, Et, E, dims[i].R, N);
  }
  if (int64_t(scratch->size_bytes()) < need) return invalid("scratch buffer too small");

  ExpertGemmArgs g{x.untyped_data(),
                   {w0.untyped_data(), num_weights > 1 ? w1.untyped_data() : nullptr},
                   {outs[0], outs[1]},
                   offsets.typed_data(), num_weights, E, M, K, N, scratch->untyped_data(),
                   int64_t(scratch->size_bytes()), int(sm_count)};
  cudaError_t err = cudaSuccess;
  GroupedArgs shrinks[kExpertMatmulMaxWeights], folds[kExpertMatmulMaxWeights];
  GroupedArgs packs[kExpertMatmulMaxWeights];
  void* pack_b[kExpertMatmulMaxWeights] = {};
  int32_t* pack_marks[kExpertMatmulMaxWeights] = {};
  int n_packs = 0;
  int64_t n_shrinks = 0;
  for (int64_t i = 0; i < num_weights && in_gemm; ++i) {
    if (!has_lora[i]) continue;
    GroupedArgs& f = folds[i] = fold_args(i, xa_plane(i));
    char* const base = static_cast<char*>(scratch->untyped_data());
    void* b_ext = packed ? rb[i].b_ext.untyped_data() : base + b_ext_at[i];
    int32_t* marks =
        packed ? rb[i].marks.typed_data() : reinterpret_cast<int32_t*>(base + marks_at[i]);
    f.skip_cells = marks;
    if (!packed) {
      packs[n_packs] = f;
      pack_b[n_packs] = b_ext;
      pack_marks[n_packs++] = marks;
    }
    g.xa_ext[i] = f.xa;
    g.b_ext[i] = b_ext;
    g.ext_k[i] = f.xa_ld;
    g.ext_experts[i] = std::min(routes[i].n_experts, E);
    // gate and up with tables of one shape and one rank: one pass over x
    GroupedArgs* first = n_shrinks == 1 ? &shrinks[0] : nullptr;
    if (first != nullptr && first->xa2 == nullptr && first->R == f.R &&
        first->route.num_loras == f.route.num_loras &&
        first->route.n_experts == f.route.n_experts && 2 * f.R <= kMaxRank) {
      first->a_pool2 = f.a_pool;
      first->route2 = f.route;
      first->xa2 = f.xa;
      first->skip_cells2 = f.skip_cells;
    } else {
      shrinks[n_shrinks++] = f;
    }
  }
  if (n_packs > 0 && err == cudaSuccess)
    err = pack_lora_ext(packs, pack_b, pack_marks, n_packs, stream);
  for (int64_t j = 0; j < n_shrinks && err == cudaSuccess; ++j)
    err = shrink_lora_ext(shrinks[j], stream);
  if (err == cudaSuccess) err = kernel->run(g, stream);
  GroupedArgs marked[kExpertMatmulMaxWeights];
  int n_marked = 0;
  for (int64_t i = 0; i < num_weights && in_gemm; ++i)
    if (has_lora[i]) marked[n_marked++] = folds[i];
  if (n_marked > 0 && err == cudaSuccess) err = fold_marked_rows(marked, n_marked, stream);
  for (int64_t i = 0; i < num_weights && !in_gemm && err == cudaSuccess; ++i)
    if (has_lora[i]) err = launch_grouped_fast(fold_args(i, xa->untyped_data()), stream);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("expert_matmul: ") +
                                                      cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

int64_t cuda_sm_count(int64_t device) {
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, int(device)) != cudaSuccess)
    return 0;
  return count;
}

int64_t expert_matmul_scratch_bytes(int64_t num_groups, int64_t sm_count) {
  int64_t bytes = 0;
  for (const ExpertGemmKernel* k : kAllKernels)
    bytes = std::max(bytes, k->scratch_bytes(num_groups, int(sm_count)));
  return bytes;
}

}  // namespace moelora

XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertMatmulCuda, moelora::ExpertMatmulCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()              // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // offsets [E + 1]
                                  .Arg<ffi::AnyBuffer>()              // w0 [E, K, N]
                                  .Arg<ffi::AnyBuffer>()              // w1 [E, K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // sorted_token_ids [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // row_adapter
                                  .Arg<ffi::AnyBuffer>()              // lora_x [num_tokens, K]
                                  .Arg<ffi::AnyBuffer>()              // route 0: a_pool
                                  .Arg<ffi::AnyBuffer>()              //          b_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()       //          a_table
                                  .Arg<ffi::Buffer<ffi::S32>>()       //          b_table
                                  .Arg<ffi::Buffer<ffi::F32>>()       //          scale_table
                                  .Arg<ffi::AnyBuffer>()              // route 1: a_pool
                                  .Arg<ffi::AnyBuffer>()              //          b_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()       //          a_table
                                  .Arg<ffi::Buffer<ffi::S32>>()       //          b_table
                                  .Arg<ffi::Buffer<ffi::F32>>()       //          scale_table
                                  .Arg<ffi::AnyBuffer>()              // route 0's packs: b_ext
                                  .Arg<ffi::Buffer<ffi::S32>>()       //                  marks
                                  .Arg<ffi::AnyBuffer>()              // route 1's packs: b_ext
                                  .Arg<ffi::Buffer<ffi::S32>>()       //                  marks
                                  .Ret<ffi::AnyBuffer>()              // out [num_weights, M, N]
                                  .Ret<ffi::AnyBuffer>()              // scratch u8
                                  .Ret<ffi::AnyBuffer>()              // xa [M, R] or [num_weights, M, L * R]
                                  .Attr<int64_t>("num_weights")
                                  .Attr<int64_t>("has_lora0")
                                  .Attr<int64_t>("has_lora1")
                                  .Attr<int64_t>("has_row_adapter")
                                  .Attr<int64_t>("sm_count")
                                  .Attr<int64_t>("pdl")
                                  .Attr<int64_t>("schedule")
                                  .Attr<int64_t>("lora_in_gemm")
                                  .Attr<int64_t>("lora_packed")
                                  .Attr<int64_t>("lora_x_gather"),
                              {ffi::Traits::kCmdBufferCompatible});
