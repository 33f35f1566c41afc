// The CUDA FFI handler of grouped_matmul (operands in grouped_matmul.h):
// checks every operand set, then one CUTLASS grouped GEMM over all of them.
#include <algorithm>
#include <string>

#include "grouped_matmul.h"
#include "moelora_handlers.h"

namespace ffi = xla::ffi;

namespace moelora {
namespace {

ffi::Error invalid(int64_t set, const std::string& what) {
  return ffi::Error::InvalidArgument("grouped_matmul: set " + std::to_string(set) + ": " + what);
}

const GroupedMatmulKernel* grouped_kernel(ffi::DataType dt, int64_t mode) {
  const bool bf16 = dt == ffi::DataType::BF16;
  switch (mode) {
    case kGmm: return bf16 ? &kGroupedMatmulBf16Gmm : &kGroupedMatmulF16Gmm;
    case kGmmRhsT: return bf16 ? &kGroupedMatmulBf16GmmRhsT : &kGroupedMatmulF16GmmRhsT;
    case kTgmm: return bf16 ? &kGroupedMatmulBf16Tgmm : &kGroupedMatmulF16Tgmm;
    case kTgmmRounded:
      return bf16 ? &kGroupedMatmulBf16TgmmRounded : &kGroupedMatmulF16TgmmRounded;
    default: return nullptr;
  }
}

// The last two dimensions of `b` and the number of planes before them.
struct Matrix {
  int64_t planes, rows, cols;
};
bool matrix(const ffi::AnyBuffer& b, int64_t min_rank, Matrix* m) {
  const auto d = b.dimensions();
  if (int64_t(d.size()) < min_rank) return false;
  m->planes = 1;
  for (size_t i = 0; i + 2 < d.size(); ++i) m->planes *= d[i];
  m->rows = d[d.size() - 2];
  m->cols = d[d.size() - 1];
  return true;
}

const void* plane(const ffi::AnyBuffer& b, int64_t index, int64_t plane_bytes) {
  return static_cast<const char*>(b.untyped_data()) + index * plane_bytes;
}

// Checks set s and fills its device description (out and acc: its results).
ffi::Error describe_set(int64_t s, int64_t mode, bool has_slots, bool has_alpha,
                        ffi::DataType dt, const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs,
                        const ffi::AnyBuffer& offsets, const ffi::AnyBuffer& slots,
                        const ffi::AnyBuffer& alpha, ffi::AnyBuffer out, int64_t lhs_plane,
                        int64_t rhs_plane, GroupedSet* set) {
  const bool tgmm = is_tgmm(mode);
  const ffi::DataType sums = mode == kTgmm ? ffi::DataType::F32 : dt;
  Matrix l{}, r{};
  if (!matrix(lhs, 2, &l)) return invalid(s, "lhs must be [..., M, K]");
  if (!matrix(rhs, tgmm ? 2 : 3, &r))
    return invalid(s, tgmm ? "rhs must be [..., M, N]" : "rhs must be [..., P, K, N]");
  if (lhs.element_type() != dt || rhs.element_type() != dt)
    return invalid(s, "lhs and rhs must share the first set's dtype");
  if (lhs_plane < 0 || lhs_plane >= l.planes) return invalid(s, "lhs_plane out of range");
  if (offsets.element_type() != ffi::DataType::S32 || offsets.element_count() < 2)
    return invalid(s, "offsets must be int32 [G + 1], G >= 1");
  const int64_t G = int64_t(offsets.element_count()) - 1, M = l.rows, K = l.cols;
  int64_t N = 0, P = 0, Q = G, rhs_planes = r.planes;
  if (tgmm) {
    if (r.rows != M) return invalid(s, "lhs and rhs must have the same rows");
    N = r.cols;
    if (has_slots && (slots.element_type() != ffi::DataType::S32 || slots.element_count() < 1))
      return invalid(s, "slots must be int32 [Q], Q >= 1");
    if (has_slots) Q = int64_t(slots.element_count());
  } else {
    const auto d = rhs.dimensions();
    P = d[d.size() - 3];  // matrices per plane
    if (P < 1) return invalid(s, "rhs has no matrices");
    rhs_planes = r.planes / P;
    const int64_t rk = mode == kGmmRhsT ? r.cols : r.rows;
    N = mode == kGmmRhsT ? r.rows : r.cols;
    if (rk != K) return invalid(s, "lhs columns and the rhs matrices' K differ");
    if (has_slots && (slots.element_type() != ffi::DataType::S32 ||
                      int64_t(slots.element_count()) != G))
      return invalid(s, "slots must be int32 [G]");
  }
  if (has_alpha &&
      (alpha.element_type() != ffi::DataType::F32 || int64_t(alpha.element_count()) != G))
    return invalid(s, "alpha must be f32 [G]");
  if (rhs_plane < 0 || rhs_plane >= rhs_planes) return invalid(s, "rhs_plane out of range");
  if (K % kExpertMatmulAlign || N % kExpertMatmulAlign)
    return invalid(s, "K and N must be multiples of kExpertMatmulAlign");
  const auto od = out.dimensions();
  if (tgmm ? (od.size() != 3 || od[0] != Q || od[1] != K || od[2] != N ||
              out.element_type() != sums)
           : (od.size() != 2 || od[0] != M || od[1] != N || out.element_type() != dt))
    return invalid(s, !tgmm            ? "out must be [M, N] in lhs' dtype"
                      : mode == kTgmm ? "out must be f32 [Q, K, N]"
                                      : "out must be [Q, K, N] in lhs' dtype");
  const int64_t e2 = 2;  // bytes of a bf16 / f16 element
  const int64_t rhs_plane_bytes = (tgmm ? M : P * K) * N * e2;
  set->lhs = plane(lhs, lhs_plane, M * K * e2);
  set->rhs = plane(rhs, rhs_plane, rhs_plane_bytes);
  set->offsets = static_cast<const int32_t*>(offsets.untyped_data());
  set->slots = has_slots ? static_cast<const int32_t*>(slots.untyped_data()) : nullptr;
  set->alpha = has_alpha ? static_cast<const float*>(alpha.untyped_data()) : nullptr;
  set->out = out.untyped_data();
  set->problems = Q;
  set->groups = G;
  set->M = M;
  set->K = K;
  set->N = N;
  set->P = P;
  return ffi::Error::Success();
}

ffi::Error GroupedMatmulCudaImpl(cudaStream_t stream, ffi::RemainingArgs args,
                                 ffi::RemainingRets rets, int64_t mode, int64_t has_slots,
                                 int64_t has_alpha, int64_t has_acc, int64_t sm_count,
                                 ffi::Span<const int64_t> lhs_plane,
                                 ffi::Span<const int64_t> rhs_plane) {
  if (mode != kGmm && mode != kGmmRhsT && mode != kTgmm && mode != kTgmmRounded)
    return ffi::Error::InvalidArgument("grouped_matmul: mode");
  if (sm_count < 1) return ffi::Error::InvalidArgument("grouped_matmul: sm_count");
  const bool acc = has_acc != 0 && (mode == kGmm || mode == kGmmRhsT);
  constexpr int64_t kOperands = 5;  // lhs, rhs, offsets, slots, alpha
  const int64_t per_set = kOperands + (acc ? 1 : 0);
  const int64_t S = int64_t(args.size()) / per_set;
  if (S < 1 || S > kGroupedMatmulMaxSets || S * per_set != int64_t(args.size()) ||
      int64_t(rets.size()) != S + 1 || int64_t(lhs_plane.size()) != S ||
      int64_t(rhs_plane.size()) != S)
    return ffi::Error::InvalidArgument("grouped_matmul: operand, result or plane counts");
  auto first = args.get<ffi::AnyBuffer>(0);
  if (first.has_error()) return first.error();
  const ffi::DataType dt = first->element_type();
  const GroupedMatmulKernel* kernel = grouped_kernel(dt, mode);
  if ((dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) || kernel == nullptr)
    return ffi::Error::InvalidArgument("grouped_matmul: dtype must be bf16 or f16");

  GroupedMatmulArgs a{};
  a.num_sets = S;
  a.acc = acc;
  a.sm_count = int(sm_count);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t at = kOperands * s;
    auto lhs = args.get<ffi::AnyBuffer>(at), rhs = args.get<ffi::AnyBuffer>(at + 1);
    auto offsets = args.get<ffi::AnyBuffer>(at + 2), slots = args.get<ffi::AnyBuffer>(at + 3);
    auto alpha = args.get<ffi::AnyBuffer>(at + 4);
    auto out = rets.get<ffi::AnyBuffer>(s);
    if (lhs.has_error() || rhs.has_error() || offsets.has_error() || slots.has_error() ||
        alpha.has_error() || out.has_error())
      return invalid(s, "operands must be arrays");
    if (auto e = describe_set(s, mode, has_slots != 0, has_alpha != 0, dt, *lhs, *rhs, *offsets,
                              *slots, *alpha, **out, lhs_plane[s], rhs_plane[s], &a.sets[s]);
        e.failure())
      return e;
    a.sets[s].first = a.total_problems;
    a.total_problems += a.sets[s].problems;
    if (acc) {  // out aliases acc; a copy only if XLA gave them distinct buffers
      auto in = args.get<ffi::AnyBuffer>(kOperands * S + s);
      if (in.has_error() || in->element_type() != dt ||
          in->element_count() != (*out)->element_count())
        return invalid(s, "acc must be [M, N] in lhs' dtype");
      if (in->untyped_data() != (*out)->untyped_data() &&
          cudaMemcpyAsync((*out)->untyped_data(), in->untyped_data(), in->size_bytes(),
                          cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
        return ffi::Error::Internal("grouped_matmul: copying acc");
    }
  }
  auto scratch = rets.get<ffi::AnyBuffer>(S);
  if (scratch.has_error()) return ffi::Error::InvalidArgument("grouped_matmul: scratch");
  a.scratch = (*scratch)->untyped_data();
  a.scratch_bytes = int64_t((*scratch)->size_bytes());
  if (a.scratch_bytes < kernel->scratch_bytes(a.total_problems, a.sm_count))
    return ffi::Error::InvalidArgument("grouped_matmul: scratch buffer too small");
  if (const cudaError_t err = kernel->run(a, stream); err != cudaSuccess)
    return ffi::Error::Internal(std::string("grouped_matmul: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

int64_t grouped_matmul_scratch_bytes(int64_t mode, int64_t num_problems, int64_t sm_count) {
  int64_t bytes = 0;
  for (const auto dt : {ffi::DataType::BF16, ffi::DataType::F16})
    if (const GroupedMatmulKernel* k = grouped_kernel(dt, mode))
      bytes = std::max(bytes, k->scratch_bytes(num_problems, int(sm_count)));
  return bytes;
}

}  // namespace moelora

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedMatmulCuda, moelora::GroupedMatmulCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("mode")
                                  .Attr<int64_t>("has_slots")
                                  .Attr<int64_t>("has_alpha")
                                  .Attr<int64_t>("has_acc")
                                  .Attr<int64_t>("sm_count")
                                  .Attr<ffi::Span<const int64_t>>("lhs_plane")
                                  .Attr<ffi::Span<const int64_t>>("rhs_plane"),
                              {ffi::Traits::kCmdBufferCompatible});
