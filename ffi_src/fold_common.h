// Skip rules shared by every C++ and CUDA fold (docs/semantics.md §5). One
// definition, compiled for host and device, so every backend skips the
// same rows.
#pragma once

#include <cstdint>

#include "moelora_constants.h"

#if defined(__CUDACC__)
#define MOELORA_HD __host__ __device__ __forceinline__
#else
#define MOELORA_HD inline
#endif

namespace moelora {

// One projection's route as raw pointers: tables are [num_loras, n_experts]
// row-major, pools hold pool_size slots (slot 0 is reserved, never adapted).
struct RouteView {
  const int32_t* a_table;
  const int32_t* b_table;
  const float* scale_table;
  int64_t num_loras;  // L
  int64_t n_experts;  // E_t, the table length
  int64_t pool_size;  // P
};

// The adapter pair one row folds with.
struct Pair {
  int32_t a;
  int32_t b;
  float scale;
};

// Decide whether a row folds and with which pair. `adapter` is the row's
// row-adapter value (0 when no map is given), `expert` its expert id.
// Returns false (fold nothing) when: adapter < 0; L > 1 and adapter >= L;
// expert outside [0, n_experts); an a or b cell is 0 or outside the pool.
MOELORA_HD bool resolve_pair(const RouteView& r, int64_t adapter, int64_t expert,
                             Pair* out) {
  if (adapter < 0) return false;
  const int64_t l = r.num_loras == 1 ? 0 : adapter;
  if (l >= r.num_loras) return false;
  if (expert < 0 || expert >= r.n_experts) return false;
  const int64_t cell = l * r.n_experts + expert;
  const int32_t a = r.a_table[cell];
  const int32_t b = r.b_table[cell];
  if (a <= 0 || b <= 0 || a >= r.pool_size || b >= r.pool_size) return false;
  out->a = a;
  out->b = b;
  out->scale = r.scale_table[cell];
  return true;
}

// Whether a grouped fold's expert_offsets are well formed (docs/malformed_metadata.md):
// 0 <= offsets[0] <= offsets[1] <= ... <= offsets[num_experts] <= te. A fold
// whose offsets are not well formed folds no row at all: every backend calls
// this once per fold (or once per CTA) before it folds anything.
MOELORA_HD bool offsets_well_formed(const int32_t* offsets, int64_t num_experts,
                                    int64_t te) {
  int64_t prev = 0;
  for (int64_t e = 0; e <= num_experts; ++e) {
    const int64_t o = offsets[e];
    if (o < prev) return false;
    prev = o;
  }
  return prev <= te;
}

// The expert whose span [offsets[e], offsets[e + 1]) holds sorted row `row`,
// or -1 when no span does. `offsets` must be well formed
// (offsets_well_formed); binary search: the last e with offsets[e] <= row.
MOELORA_HD int64_t find_expert(const int32_t* offsets, int64_t num_experts,
                               int64_t row) {
  int64_t lo = 0, hi = num_experts + 1;  // answer in [lo, hi)
  if (num_experts <= 0 || row < offsets[0]) return -1;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= row) lo = mid; else hi = mid;
  }
  if (lo >= num_experts || row >= offsets[lo + 1]) return -1;
  return lo;
}

// Token of a sorted row and its row-adapter value, with bounds checks:
// returns false when the token lies outside [0, num_tokens) but is needed
// (to read x with x_gather = 1, or the row-adapter map).
MOELORA_HD bool grouped_row_adapter(const int32_t* sorted_token_ids,
                                    const int32_t* row_adapter,
                                    bool has_row_adapter, int64_t num_tokens,
                                    bool x_gather, int64_t row,
                                    int64_t* token, int64_t* adapter) {
  const int64_t t = sorted_token_ids[row];
  *token = t;
  *adapter = 0;
  const bool need_token = x_gather || has_row_adapter;
  if (need_token && (t < 0 || t >= num_tokens)) return false;
  if (has_row_adapter) *adapter = row_adapter[t];
  return true;
}

// The base_out row a grouped fold's sorted row `row` reads and writes:
// out_rows[row], or `row` itself when out_rows is null (the identity);
// returns false (the row folds nothing) when it lies outside [0, m), m the
// rows of base_out.
MOELORA_HD bool grouped_out_row(const int32_t* out_rows, int64_t m, int64_t row,
                                int64_t* out_row) {
  const int64_t o = out_rows ? int64_t(out_rows[row]) : row;
  *out_row = o;
  return o >= 0 && o < m;
}

// Whether a gather fold writes rows into its second buffer: the dense expert
// layout with more (virtual) experts than one buffer holds.
MOELORA_HD bool gather_uses_out2(int64_t n_experts, int64_t dense_tokens,
                                 int64_t dense_experts) {
  return dense_tokens > 0 && n_experts > dense_experts;
}

// The x row a gather fold's flat row `row` reads when it folds with expert
// `expert` (XLayout, moelora_constants.h); kXDense: `expert` is a member-0
// expert in [0, dense_experts).
MOELORA_HD int64_t gather_x_row(int64_t x_gather, int64_t row, int64_t top_k, int64_t expert,
                                int64_t dense_tokens) {
  if (x_gather == kXRows) return row;
  const int64_t token = row / top_k;
  return x_gather == kXTokens ? token : expert * dense_tokens + token;
}

// The output row of a gather fold's flat row `row` (token `token`) that folds
// with (virtual) expert `expert`, in [0, n_experts). Flat layout
// (dense_tokens == 0): row `row` of buffer 0. Dense expert layout: buffer
// expert / dense_experts (0 or 1: the member of a stacked route), row
// (expert % dense_experts) * dense_tokens + token of that buffer's
// [dense_experts, dense_tokens, N] rows.
MOELORA_HD int64_t gather_out_row(int64_t row, int64_t token, int64_t expert,
                                  int64_t dense_tokens, int64_t dense_experts, int* buffer) {
  if (dense_tokens == 0) {
    *buffer = 0;
    return row;
  }
  const int64_t s = expert >= dense_experts ? 1 : 0;
  *buffer = int(s);
  return (expert - s * dense_experts) * dense_tokens + token;
}

}  // namespace moelora
