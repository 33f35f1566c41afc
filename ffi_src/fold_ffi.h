// FFI bindings and host-side operand checks of both folds, shared by the CPU
// and CUDA handlers (Python validates first; these guard the raw buffers).
// The operand layout is documented in moelora_handlers.h.
#pragma once

#include <cstdint>
#include <utility>

#include "fold_common.h"
#include "xla/ffi/api/ffi.h"

namespace moelora {

namespace ffi = xla::ffi;

struct Dims {
  int64_t K, N, R, P;
};

// Whether x's dtype suits a fold in dtype dt: the same, or (narrow_x, the
// gather fold) bf16 or f16 x with f32 pools, read widened (exactly).
inline bool x_dtype_ok(ffi::DataType x, ffi::DataType dt, bool narrow_x) {
  return x == dt || (narrow_x && dt == ffi::DataType::F32 &&
                     (x == ffi::DataType::BF16 || x == ffi::DataType::F16));
}

// The route's checks against activations x [M, K] and outputs of n_out
// columns in dtype dt (x in dt, or narrower where narrow_x: x_dtype_ok).
inline ffi::Error check_route_for(ffi::AnyBuffer x, int64_t n_out, ffi::DataType dt,
                                  ffi::AnyBuffer a_pool, ffi::AnyBuffer b_pool,
                                  ffi::Buffer<ffi::S32> a_table, ffi::Buffer<ffi::S32> b_table,
                                  ffi::Buffer<ffi::F32> scale_table, Dims* d, RouteView* route,
                                  bool narrow_x = false) {
  auto xd = x.dimensions();
  auto ad = a_pool.dimensions(), pd = b_pool.dimensions(), td = a_table.dimensions();
  if (xd.size() != 2 || ad.size() != 3 || pd.size() != 3 || td.size() != 2)
    return ffi::Error::InvalidArgument("moe_lora fold: operand ranks are wrong");
  if (!x_dtype_ok(x.element_type(), dt, narrow_x) || a_pool.element_type() != dt ||
      b_pool.element_type() != dt)
    return ffi::Error::InvalidArgument("moe_lora fold: x, base_out and pools differ in dtype");
  d->P = ad[0]; d->R = ad[1]; d->K = ad[2]; d->N = pd[1];
  if (xd[1] != d->K || n_out != d->N || pd[0] != d->P || pd[2] != d->R || d->R > kMaxRank)
    return ffi::Error::InvalidArgument("moe_lora fold: pool and activation shapes disagree");
  auto same = [&](auto dims) { return dims.size() == 2 && dims[0] == td[0] && dims[1] == td[1]; };
  if (!same(b_table.dimensions()) || !same(scale_table.dimensions()))
    return ffi::Error::InvalidArgument("moe_lora fold: table shapes differ");
  *route = RouteView{a_table.typed_data(), b_table.typed_data(), scale_table.typed_data(),
                     td[0], td[1], d->P};
  return ffi::Error::Success();
}

// The same checks against base_out [rows, n_out].
inline ffi::Error check_route(ffi::AnyBuffer x, ffi::AnyBuffer base, ffi::AnyBuffer a_pool,
                       ffi::AnyBuffer b_pool, ffi::Buffer<ffi::S32> a_table,
                       ffi::Buffer<ffi::S32> b_table, ffi::Buffer<ffi::F32> scale_table,
                       Dims* d, RouteView* route, bool narrow_x = false) {
  if (base.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("moe_lora fold: operand ranks are wrong");
  return check_route_for(x, base.dimensions()[1], base.element_type(), a_pool, b_pool, a_table,
                         b_table, scale_table, d, route, narrow_x);
}

// Every check of a moe_lora_gather_bgmv call; fills the dims, the route and
// the flat rows n_slots (indices' length). Flat layout (dense_tokens == 0):
// base_out has n_slots rows. Dense expert layout: base_out (and base2, when
// the route's experts reach past dense_experts) holds [dense_experts,
// dense_tokens] rows, one token per n_slots / top_k; the route has at most
// 2 * dense_experts (virtual) experts. x_gather (XLayout): x holds n_slots
// rows, n_slots / top_k tokens, or the dense layout's rows (a route of one
// member).
inline ffi::Error check_gather(ffi::AnyBuffer x, ffi::AnyBuffer base, ffi::AnyBuffer base2,
                               ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> row_adapter,
                               ffi::AnyBuffer a_pool, ffi::AnyBuffer b_pool,
                               ffi::Buffer<ffi::S32> a_table, ffi::Buffer<ffi::S32> b_table,
                               ffi::Buffer<ffi::F32> scale_table, int64_t top_k, int64_t x_gather,
                               int64_t has_row_adapter, int64_t dense_tokens,
                               int64_t dense_experts, Dims* d, RouteView* route,
                               int64_t* n_slots_out) {
  if (auto e = check_route(x, base, a_pool, b_pool, a_table, b_table, scale_table, d, route,
                           /*narrow_x=*/true);
      e.failure())
    return e;
  const int64_t n_slots = int64_t(indices.element_count());
  *n_slots_out = n_slots;
  if (top_k < 1 || n_slots % top_k)
    return ffi::Error::InvalidArgument("moe_lora_gather_bgmv: bad top_k or indices length");
  if (dense_tokens == 0) {
    if (base.dimensions()[0] != n_slots)
      return ffi::Error::InvalidArgument("moe_lora_gather_bgmv: indices and base_out rows differ");
  } else {
    const auto bd = base.dimensions(), b2 = base2.dimensions();
    const bool two = gather_uses_out2(route->n_experts, dense_tokens, dense_experts);
    if (dense_tokens < 0 || dense_experts < 1 || n_slots / top_k != dense_tokens ||
        bd[0] != dense_experts * dense_tokens || route->n_experts > 2 * dense_experts ||
        (two && (b2.size() != 2 || b2[0] != bd[0] || b2[1] != bd[1] ||
                 base2.element_type() != base.element_type())))
      return ffi::Error::InvalidArgument("moe_lora_gather_bgmv: bad dense expert layout");
  }
  if (x_gather < kXRows || x_gather > kXDense ||
      (x_gather == kXDense && (dense_tokens == 0 || route->n_experts > dense_experts)))
    return ffi::Error::InvalidArgument(
        "moe_lora_gather_bgmv: x_gather must be 0, 1, or 2 with a one-member dense layout");
  const int64_t x_rows = x_gather == kXRows     ? n_slots
                         : x_gather == kXTokens ? n_slots / top_k
                                                : dense_experts * dense_tokens;
  if (x.dimensions()[0] != x_rows)
    return ffi::Error::InvalidArgument("moe_lora_gather_bgmv: x rows do not match x_gather");
  if (has_row_adapter && int64_t(row_adapter.element_count()) != n_slots / top_k)
    return ffi::Error::InvalidArgument("moe_lora_gather_bgmv: row_adapter length");
  return ffi::Error::Success();
}

// Every check of a moe_lora_grouped_down call; fills the dims and the route.
// The sorted rows te are sorted_token_ids' length; base_out has te rows
// without out_rows, any number with (out_rows then holds te entries).
inline ffi::Error check_grouped(ffi::AnyBuffer x, ffi::AnyBuffer base,
                                ffi::Buffer<ffi::S32> expert_offsets,
                                ffi::Buffer<ffi::S32> sorted_token_ids,
                                ffi::Buffer<ffi::S32> out_rows, ffi::AnyBuffer a_pool,
                                ffi::AnyBuffer b_pool, ffi::Buffer<ffi::S32> a_table,
                                ffi::Buffer<ffi::S32> b_table, ffi::Buffer<ffi::F32> scale_table,
                                int64_t x_gather, int64_t has_out_rows, Dims* d,
                                RouteView* route) {
  if (auto e = check_route(x, base, a_pool, b_pool, a_table, b_table, scale_table, d, route);
      e.failure())
    return e;
  const int64_t te = int64_t(sorted_token_ids.element_count());
  const int64_t num_experts = int64_t(expert_offsets.element_count()) - 1;
  if (num_experts < route->n_experts)
    return ffi::Error::InvalidArgument("moe_lora_grouped_down: offsets length");
  if (has_out_rows ? int64_t(out_rows.element_count()) != te : base.dimensions()[0] != te)
    return ffi::Error::InvalidArgument(
        "moe_lora_grouped_down: sorted ids, out_rows and base_out rows disagree");
  if (!x_gather && x.dimensions()[0] != te)
    return ffi::Error::InvalidArgument("moe_lora_grouped_down: x rows do not match x_gather");
  return ffi::Error::Success();
}

// The operands, results and attributes of moe_lora_gather_bgmv, appended to
// a binding that may already hold a context (the CUDA stream).
template <class B>
auto bind_gather(B binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()                   // base_out
      .template Arg<ffi::AnyBuffer>()                   // base2
      .template Arg<ffi::Buffer<ffi::S32>>()            // indices
      .template Arg<ffi::Buffer<ffi::S32>>()            // row_adapter
      .template Arg<ffi::AnyBuffer>()                   // a_pool
      .template Arg<ffi::AnyBuffer>()                   // b_pool
      .template Arg<ffi::Buffer<ffi::S32>>()            // a_table
      .template Arg<ffi::Buffer<ffi::S32>>()            // b_table
      .template Arg<ffi::Buffer<ffi::F32>>()            // scale_table
      .template Ret<ffi::AnyBuffer>()                   // out (aliases base_out)
      .template Ret<ffi::AnyBuffer>()                   // out2 (aliases base2)
      .template Ret<ffi::AnyBuffer>()                   // xa scratch
      .template Attr<int64_t>("top_k")
      .template Attr<int64_t>("x_gather")
      .template Attr<int64_t>("has_row_adapter")
      .template Attr<int64_t>("dense_tokens")
      .template Attr<int64_t>("dense_experts")
      .template Attr<int64_t>("pdl")
      .template Attr<int64_t>("variant")
      .template Attr<int64_t>("keep_xa");
}

// A gather call's xa result against keep_xa (moelora_handlers.h): n_slots
// rows of R values, twice that with keep_xa = 1.
inline ffi::Error check_gather_xa(ffi::Result<ffi::AnyBuffer> xa, ffi::DataType dt,
                                  int64_t n_slots, int64_t R, int64_t keep_xa) {
  if (keep_xa != 0 && keep_xa != 1)
    return ffi::Error::InvalidArgument("moe_lora_gather_bgmv: keep_xa must be 0 or 1");
  if (xa->element_type() != dt || int64_t(xa->element_count()) != (1 + keep_xa) * n_slots * R)
    return ffi::Error::InvalidArgument("moe_lora_gather_bgmv: the xa result's size");
  return ffi::Error::Success();
}

// The operands, results and attributes of moe_lora_grouped_down.
template <class B>
auto bind_grouped(B binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()                   // base_out
      .template Arg<ffi::Buffer<ffi::S32>>()            // expert_offsets
      .template Arg<ffi::Buffer<ffi::S32>>()            // sorted_token_ids
      .template Arg<ffi::Buffer<ffi::S32>>()            // row_adapter
      .template Arg<ffi::Buffer<ffi::S32>>()            // out_rows
      .template Arg<ffi::AnyBuffer>()                   // a_pool
      .template Arg<ffi::AnyBuffer>()                   // b_pool
      .template Arg<ffi::Buffer<ffi::S32>>()            // a_table
      .template Arg<ffi::Buffer<ffi::S32>>()            // b_table
      .template Arg<ffi::Buffer<ffi::F32>>()            // scale_table
      .template Ret<ffi::AnyBuffer>()                   // out (aliases base_out)
      .template Ret<ffi::AnyBuffer>()                   // xa scratch
      .template Attr<int64_t>("row_offset")
      .template Attr<int64_t>("row_end")
      .template Attr<int64_t>("x_gather")
      .template Attr<int64_t>("has_row_adapter")
      .template Attr<int64_t>("has_out_rows")
      .template Attr<int64_t>("pdl")
      .template Attr<int64_t>("variant");
}

}  // namespace moelora
