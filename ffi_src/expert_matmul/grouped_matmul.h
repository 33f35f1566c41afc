// grouped_matmul: grouped GEMMs over row groups (CUDA, sm90), host interface.
//
// Custom call "grouped_matmul" (registered for CUDA only; elsewhere
// jax_moelora/ops/grouped_matmul.py computes the same with ragged_dot). One
// call runs S independent operand sets (1 <= S <= kGroupedMatmulMaxSets) in
// one CUTLASS launch. Set s:
//   lhs      [..., M, K]: plane lhs_plane[s] of its leading dimensions
//   rhs      kGmm [..., P, K, N], kGmmRhsT [..., P, N, K], kTgmm [..., M, N]:
//            plane rhs_plane[s]
//   offsets  int32 [G + 1], non-decreasing: group g holds the rows
//            [offsets[g], offsets[g + 1]) (clipped into [0, M])
//   slots    int32 [G] (kGmm, kGmmRhsT with has_slots): group g multiplies
//            rhs matrix slots[g]; a value outside [0, P) skips the group.
//            Without slots group g multiplies matrix g.
//            int32 [Q] (kTgmm, kTgmmRounded with has_slots): output matrix q
//            is group slots[q]'s; a value outside [0, G) gives zeros. Without
//            slots Q = G and matrix q is group q's.
//   alpha    f32 [G] (with has_alpha): group g's product or sum is scaled by
//            alpha[g] before the rounding; without: by 1.
// operands: the S sets' (lhs, rhs, offsets, slots, alpha) in turn (slots and
//           alpha: any int32 / f32 array when has_slots / has_alpha = 0),
//           then with has_acc one acc_s [M, N] per set (each aliased to its
//           out_s).
// results:  out_s per set, kGmm / kGmmRhsT [M, N] in the lhs dtype, kTgmm
//           f32 [Q, K, N], kTgmmRounded [Q, K, N] in the lhs dtype; then
//           scratch u8 [grouped_matmul_scratch_bytes(mode, total problems,
//           sm_count)] (a set's problems: its G groups, or its Q matrices for
//           kTgmm*).
// attrs:    mode (GroupedMatmulMode), has_slots, has_alpha, has_acc, sm_count,
//           lhs_plane, rhs_plane (int64 arrays [S]).
//
// kGmm / kGmmRhsT: row r of a group that is not skipped is
//   out[r] = round(alpha[g] * (lhs[r] @ rhs[slot]) (+ acc[r]))   (rhs[slot]^T for kGmmRhsT)
// with fp32 accumulation and one rounding; every other row is acc[r]
// (has_acc) or 0. kTgmm: out[q] = alpha[g] * sum over the rows r of group g
// = slots[q] (or q) of lhs[r]^T rhs[r] (an outer product), fp32, never
// rounded; a matrix of no group, or of a group without rows, is 0.
// kTgmmRounded: the same sums rounded once to lhs' dtype.
// Every output element is written by one CTA in a fixed order: the results
// do not vary from run to run.
//
// lhs and rhs of every set share one dtype, bf16 or f16; every K and N is a
// multiple of kExpertMatmulAlign.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_common.cuh"
#include "expert_matmul.h"
#include "moelora_constants.h"

namespace moelora {

// The transposed modes: one [K, N] output per group, the group's rows the reduction.
constexpr bool is_tgmm(int64_t mode) { return mode == kTgmm || mode == kTgmmRounded; }

// One operand set on the device (pointers already moved to their planes).
struct GroupedSet {
  const void* lhs;           // [M, K]
  const void* rhs;           // kGmm [P, K, N], kGmmRhsT [P, N, K], kTgmm* [M, N]
  const int32_t* offsets;    // [groups + 1]
  const int32_t* slots;      // kGmm*: [groups], the rhs matrix of each group;
                             // kTgmm*: [problems], the group of each output
                             // matrix; nullptr: the identity
  const float* alpha;        // [groups], or nullptr: 1
  void* out;                 // [M, N], or [problems, K, N] (f32 for kTgmm)
  int64_t groups, M, K, N, P;
  int64_t problems;          // groups (kGmm*), or output matrices (kTgmm*)
  int64_t first;             // index of the set's first problem in the launch
};

struct GroupedMatmulArgs {
  GroupedSet sets[kGroupedMatmulMaxSets];
  int64_t num_sets, total_problems;
  bool acc;                  // kGmm / kGmmRhsT: add to out (C = D)
  void* scratch;
  int64_t scratch_bytes;
  int sm_count;
};

// grouped_matmul's kernels, per dtype and mode (grouped_matmul_<dtype>_<mode>.cu;
// GemmKernel in expert_matmul.h).
using GroupedMatmulKernel = GemmKernel<GroupedMatmulArgs>;
extern const GroupedMatmulKernel kGroupedMatmulBf16Gmm, kGroupedMatmulBf16GmmRhsT,
    kGroupedMatmulBf16Tgmm, kGroupedMatmulBf16TgmmRounded, kGroupedMatmulF16Gmm,
    kGroupedMatmulF16GmmRhsT, kGroupedMatmulF16Tgmm, kGroupedMatmulF16TgmmRounded;

}  // namespace moelora
