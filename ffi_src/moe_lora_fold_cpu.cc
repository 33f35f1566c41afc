// C++ XLA FFI handlers of both folds for platform "cpu" (docs/semantics.md §5).
// Same skip rules (fold_common.h) and roundings as the CUDA kernels: xa and
// delta accumulate in fp32 and round to the activation dtype, then
// out = round(float(out) + scale * float(delta)). No allocation: xa lives in
// the op's scratch output.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fold_ffi.h"
#include "fold_common.h"
#include "moelora_handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moelora {
namespace {

// ---- dtype conversions (round to nearest even, NaN kept quiet) ----------

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

struct Bf16 {
  using T = uint16_t;
  static float to_f(T h) { return bits_to_float(uint32_t(h) << 16); }
  static T from_f(float f) {
    uint32_t u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return T((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return T(u >> 16);
  }
};

struct F16 {
  using T = uint16_t;
  static float to_f(T h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact in fp32
      const float v = float(m) * (1.0f / 16777216.0f);
      return sign ? -v : v;
    }
    if (e == 31) return bits_to_float(sign | 0x7f800000u | (m << 13));
    return bits_to_float(sign | ((e + 112u) << 23) | (m << 13));
  }
  static T from_f(float f) {
    const uint32_t x = float_to_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return T(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return T(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (ax < 0x38800000u) {  // below 2^-14: subnormal half, m = rint(v * 2^24)
      const float v = bits_to_float(ax) * 16777216.0f;  // exact scaling
      return T(sign | uint32_t(std::nearbyint(v)));
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu);
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return T(sign | h);
  }
};

struct F32 {
  using T = float;
  static float to_f(T v) { return v; }
  static T from_f(float f) { return f; }
};

// ---- one folded row ------------------------------------------------------

// fp32 dot product of two length-n rows (a in CA's dtype, b in CB's) with 8
// independent partial sums (the summation order differs from a serial loop;
// docs/semantics.md §6 allows that).
template <class CA, class CB = CA>
inline float dot(const typename CA::T* a, const typename CB::T* b, int64_t n) {
  constexpr int kLanes = 8;
  float acc[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int u = 0; u < kLanes; ++u) acc[u] += CA::to_f(a[k + u]) * CB::to_f(b[k + u]);
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; k < n; ++k) s += CA::to_f(a[k]) * CB::to_f(b[k]);
  return s;
}

// One row: x in CX's dtype (C's, or bf16/f16 widened exactly under f32 pools).
template <class C, class CX = C>
void fold_row(const typename CX::T* xrow, const typename C::T* A, const typename C::T* B,
              int64_t K, int64_t R, int64_t N, float scale, typename C::T* xa,
              typename C::T* out_row) {
  for (int64_t j = 0; j < R; ++j) xa[j] = C::from_f(dot<CX, C>(xrow, A + j * K, K));
  for (int64_t n = 0; n < N; ++n) {
    const float delta = C::to_f(C::from_f(dot<C>(xa, B + n * R, R)));
    const float scaled = scale * delta;
    out_row[n] = C::from_f(C::to_f(out_row[n]) + scaled);
  }
}

// Copy `base` into `out` when XLA did not alias them.
inline void copy_unaliased(ffi::AnyBuffer base, void* out) {
  if (out != base.untyped_data()) std::memcpy(out, base.untyped_data(), base.size_bytes());
}

// The typed pointers of one fold, with base_out copied into out first when
// XLA did not alias them; fold(row, x_row, out_row, pair) folds one row
// (into out2's row with buffer 1: a gather fold's second base). x in CX's
// dtype.
template <class C, class CX = C>
struct FoldBuffers {
  using T = typename C::T;
  const typename CX::T* x;
  const T *a_pool, *b_pool;
  T *out, *xa, *out2 = nullptr;
  Dims d;

  FoldBuffers(ffi::AnyBuffer xb, ffi::AnyBuffer base, ffi::AnyBuffer ab, ffi::AnyBuffer bb,
              ffi::Result<ffi::AnyBuffer> ob, ffi::Result<ffi::AnyBuffer> xab, const Dims& dims)
      : x(static_cast<const typename CX::T*>(xb.untyped_data())),
        a_pool(static_cast<const T*>(ab.untyped_data())),
        b_pool(static_cast<const T*>(bb.untyped_data())),
        out(static_cast<T*>(ob->untyped_data())),
        xa(static_cast<T*>(xab->untyped_data())),
        d(dims) {
    copy_unaliased(base, out);
  }

  // Row `row` (its xa row) folds x row `x_row` into out row `out_row`.
  void fold(int64_t row, int64_t x_row, int64_t out_row, const Pair& p, int buffer = 0) const {
    fold_row<C, CX>(x + x_row * d.K, a_pool + int64_t(p.a) * d.R * d.K,
                    b_pool + int64_t(p.b) * d.N * d.R, d.K, d.R, d.N, p.scale, xa + row * d.R,
                    (buffer ? out2 : out) + out_row * d.N);
  }
};

template <class C, class CX>
void gather_impl(ffi::AnyBuffer x, ffi::AnyBuffer base, ffi::AnyBuffer base2, int64_t n_slots,
                 const int32_t* indices, const int32_t* row_adapter, bool has_ra,
                 ffi::AnyBuffer a_pool, ffi::AnyBuffer b_pool, const RouteView& route,
                 const Dims& d, int64_t top_k, int64_t x_gather, int64_t dense_tokens,
                 int64_t dense_experts, ffi::Result<ffi::AnyBuffer> out,
                 ffi::Result<ffi::AnyBuffer> out2, ffi::Result<ffi::AnyBuffer> xa) {
  FoldBuffers<C, CX> buf(x, base, a_pool, b_pool, out, xa, d);
  if (gather_uses_out2(route.n_experts, dense_tokens, dense_experts)) {
    buf.out2 = static_cast<typename C::T*>(out2->untyped_data());
    copy_unaliased(base2, buf.out2);
  }
  for (int64_t row = 0; row < n_slots; ++row) {
    const int64_t t = row / top_k;
    Pair p;
    if (!resolve_pair(route, has_ra ? row_adapter[t] : 0, indices[row], &p)) continue;
    int buffer;
    const int64_t o = gather_out_row(row, t, indices[row], dense_tokens, dense_experts, &buffer);
    buf.fold(row, gather_x_row(x_gather, row, top_k, indices[row], dense_tokens), o, p, buffer);
  }
}

// te sorted rows; sorted row r folds into out row out_rows[r] (out_rows null:
// row r), skipped when that lies outside base_out's rows.
template <class C>
void grouped_impl(ffi::AnyBuffer x, ffi::AnyBuffer base, const int32_t* offsets,
                  int64_t num_experts, const int32_t* sorted_token_ids, int64_t te,
                  const int32_t* row_adapter, bool has_ra, int64_t num_ra,
                  const int32_t* out_rows, ffi::AnyBuffer a_pool, ffi::AnyBuffer b_pool,
                  const RouteView& route, const Dims& d, int64_t row_offset, int64_t row_end,
                  bool x_gather, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> xa) {
  const int64_t m = base.dimensions()[0];
  const FoldBuffers<C> buf(x, base, a_pool, b_pool, out, xa, d);
  if (!offsets_well_formed(offsets, num_experts, te)) return;  // fold no row
  const int64_t num_tokens = x_gather ? x.dimensions()[0] : num_ra;
  const int64_t lo = row_offset < 0 ? 0 : row_offset, hi = row_end < te ? row_end : te;
  for (int64_t r = lo; r < hi; ++r) {
    int64_t out_row;
    if (!grouped_out_row(out_rows, m, r, &out_row)) continue;
    const int64_t e = find_expert(offsets, num_experts, r);
    if (e < 0) continue;
    int64_t tok, adapter;
    if (!grouped_row_adapter(sorted_token_ids, row_adapter, has_ra, num_tokens, x_gather, r,
                             &tok, &adapter))
      continue;
    Pair p;
    if (!resolve_pair(route, adapter, e, &p)) continue;
    buf.fold(r, x_gather ? tok : r, out_row, p);
  }
}

template <class C>
struct GroupedFn {
  template <class... A> static void run(A&&... a) { grouped_impl<C>(a...); }
};
template <class C>
struct GatherFn {
  template <class... A> static void run(A&&... a) { gather_impl<C, C>(a...); }
};

template <template <class> class Fn, class... Args>
ffi::Error dispatch(ffi::DataType dt, Args&&... args) {
  switch (dt) {
    case ffi::DataType::BF16: Fn<Bf16>::run(args...); return ffi::Error::Success();
    case ffi::DataType::F16: Fn<F16>::run(args...); return ffi::Error::Success();
    case ffi::DataType::F32: Fn<F32>::run(args...); return ffi::Error::Success();
    default: return ffi::Error::InvalidArgument("moe_lora fold: dtype must be bf16, f16 or f32");
  }
}

// The gather fold in dtype dt with x in xdt (x_dtype_ok: dt, or bf16/f16
// under f32 pools).
template <class... Args>
ffi::Error dispatch_gather(ffi::DataType dt, ffi::DataType xdt, Args&&... args) {
  if (dt == ffi::DataType::F32 && xdt == ffi::DataType::BF16) {
    gather_impl<F32, Bf16>(args...);
    return ffi::Error::Success();
  }
  if (dt == ffi::DataType::F32 && xdt == ffi::DataType::F16) {
    gather_impl<F32, F16>(args...);
    return ffi::Error::Success();
  }
  return dispatch<GatherFn>(dt, args...);
}

ffi::Error GatherBgmvCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer base, ffi::AnyBuffer base2,
                             ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> row_adapter,
                             ffi::AnyBuffer a_pool, ffi::AnyBuffer b_pool,
                             ffi::Buffer<ffi::S32> a_table, ffi::Buffer<ffi::S32> b_table,
                             ffi::Buffer<ffi::F32> scale_table, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> out2, ffi::Result<ffi::AnyBuffer> xa,
                             int64_t top_k, int64_t x_gather, int64_t has_row_adapter,
                             int64_t dense_tokens, int64_t dense_experts, int64_t pdl,
                             int64_t variant, int64_t keep_xa) {
  (void)variant;  // one CPU implementation serves every variant
  (void)pdl;      // a launch option of the CUDA kernels
  Dims d;
  RouteView route;
  int64_t n_slots;
  if (auto e = check_gather(x, base, base2, indices, row_adapter, a_pool, b_pool, a_table,
                            b_table, scale_table, top_k, x_gather, has_row_adapter, dense_tokens,
                            dense_experts, &d, &route, &n_slots);
      e.failure())
    return e;
  // every folding row's xa is written at its row of xa: with keep_xa, the
  // kept rows are the first n_slots
  if (auto e = check_gather_xa(xa, base.element_type(), n_slots, d.R, keep_xa); e.failure())
    return e;
  return dispatch_gather(base.element_type(), x.element_type(), x, base, base2, n_slots,
                         indices.typed_data(), row_adapter.typed_data(), has_row_adapter != 0,
                         a_pool, b_pool, route, d, top_k, x_gather, dense_tokens, dense_experts,
                         out, out2, xa);
}

ffi::Error GroupedDownCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer base,
                              ffi::Buffer<ffi::S32> expert_offsets,
                              ffi::Buffer<ffi::S32> sorted_token_ids,
                              ffi::Buffer<ffi::S32> row_adapter, ffi::Buffer<ffi::S32> out_rows,
                              ffi::AnyBuffer a_pool, ffi::AnyBuffer b_pool,
                              ffi::Buffer<ffi::S32> a_table, ffi::Buffer<ffi::S32> b_table,
                              ffi::Buffer<ffi::F32> scale_table, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> xa, int64_t row_offset, int64_t row_end,
                              int64_t x_gather, int64_t has_row_adapter, int64_t has_out_rows,
                              int64_t pdl, int64_t variant) {
  (void)variant;
  (void)pdl;
  Dims d;
  RouteView route;
  if (auto e = check_grouped(x, base, expert_offsets, sorted_token_ids, out_rows, a_pool, b_pool,
                             a_table, b_table, scale_table, x_gather, has_out_rows, &d, &route);
      e.failure())
    return e;
  const int64_t num_experts = int64_t(expert_offsets.element_count()) - 1;
  return dispatch<GroupedFn>(base.element_type(), x, base, expert_offsets.typed_data(),
                             num_experts, sorted_token_ids.typed_data(),
                             int64_t(sorted_token_ids.element_count()), row_adapter.typed_data(),
                             has_row_adapter != 0, int64_t(row_adapter.element_count()),
                             has_out_rows ? out_rows.typed_data() : nullptr, a_pool, b_pool,
                             route, d, row_offset, row_end, x_gather != 0, out, xa);
}

}  // namespace
}  // namespace moelora

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeLoraGatherBgmvCpu, moelora::GatherBgmvCpuImpl,
                              moelora::bind_gather(ffi::Ffi::Bind()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeLoraGroupedDownCpu, moelora::GroupedDownCpuImpl,
                              moelora::bind_grouped(ffi::Ffi::Bind()),
                              {ffi::Traits::kCmdBufferCompatible});
