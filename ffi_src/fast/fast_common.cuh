// Device and host helpers shared by the tuned ("fast") fold kernels under
// ffi_src/fast/: tensor-core mma wrappers, 16-byte loads, dtype conversions,
// launch helpers, and the launchers each kernel file exports to the two
// dispatchers (launch_gather_fast in decode_cells.cu, launch_grouped_fast in
// prefill_expand.cu).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "cuda_common.cuh"

namespace moelora {
namespace fast {

// ---------------------------------------------------------------- mma ------

template <DType D> struct Mma;
template <> struct Mma<DType::kBf16> {
  static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};
template <> struct Mma<DType::kF16> {
  static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// ------------------------------------------------ conversions, copies --------

template <DType D>
__device__ __forceinline__ float h2f(uint16_t h) {
  using T = typename Traits<D>::T;
  T v;
  memcpy(&v, &h, 2);
  return Traits<D>::to_f(v);
}
template <DType D>
__device__ __forceinline__ uint16_t f2h(float f) {
  using T = typename Traits<D>::T;
  T v = Traits<D>::from_f(f);
  uint16_t h;
  memcpy(&h, &v, 2);
  return h;
}

// Two 16-bit values packed in a 32-bit word (the first in the low half), and
// a pair of adjacent outputs folded at once: round(out + s * round(d)) for
// each, the roundings of fold_add on single values, converted two at a time
// (one cvt.rn.{bf16,f16}x2.f32 instead of two).
template <DType D>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (D == DType::kBf16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&r, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&r, &v, 4);
  }
  return r;
}
template <DType D>
__device__ __forceinline__ uint32_t fold_pair(uint32_t out2, float scale, float d0, float d1) {
  const uint32_t dr = pack2<D>(d0, d1);
  return pack2<D>(fold_add(h2f<D>(uint16_t(out2 & 0xffffu)), scale, h2f<D>(uint16_t(dr & 0xffffu))),
                  fold_add(h2f<D>(uint16_t(out2 >> 16)), scale, h2f<D>(uint16_t(dr >> 16))));
}

// 16-byte asynchronous copy global -> shared (zero-filled when !valid; src
// must still be a mapped address), and the group commit and waits.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
// The same copy with an L2 eviction policy (l2_evict_first: data read once,
// which should not push out of L2 what is read again).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid,
                                           uint64_t policy) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(d),
               "l"(src), "r"(valid ? 16 : 0), "l"(policy)
               : "memory");
}
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t l2_evict_normal() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Bulk asynchronous copies (TMA, no tensor map) global -> shared, completed
// on an mbarrier that counts the bytes: `bytes` and both addresses multiples
// of 16. One thread arms the barrier with the stage's bytes and issues the
// copies; every thread waits on the barrier's phase parity.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}
// After mbar_init and before a barrier: the barriers' initialisation visible
// to the async proxy that completes them.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Orders this CTA's earlier generic-proxy accesses of shared memory before
// later async-proxy writes (a stage is refilled after the CTA read it).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// The (table row, expert) a gather row folds with, or false when the row is
// skipped before any table lookup (negative adapter, adapter past the table,
// expert outside the table).
__device__ __forceinline__ bool gather_row_cell(const GatherArgs& a, int64_t row, int* l, int* e) {
  const int64_t ad = a.has_row_adapter ? int64_t(a.row_adapter[row / a.top_k]) : 0;
  if (ad < 0) return false;
  const int64_t ll = a.route.num_loras == 1 ? 0 : ad;
  if (ll >= a.route.num_loras) return false;
  const int64_t ee = a.indices[row];
  if (ee < 0 || ee >= a.route.n_experts) return false;
  *l = int(ll);
  *e = int(ee);
  return true;
}

// fold_common.h's offsets_well_formed decided by the whole CTA (threads
// check adjacent pairs in parallel): a grouped kernel folds nothing when it
// is false. Every thread of the CTA must call it (it synchronises the CTA).
__device__ __forceinline__ bool cta_offsets_well_formed(const int32_t* offsets, int64_t num_experts,
                                                        int64_t te) {
  int bad = 0;
  for (int64_t e = threadIdx.x; e <= num_experts; e += blockDim.x) {
    const int64_t v = offsets[e];
    if (v < (e == 0 ? 0 : int64_t(offsets[e - 1])) || (e == num_experts && v > te)) bad = 1;
  }
  return !__syncthreads_or(bad);
}

// Rows per tile of the prefill kernels' ranking (rank_tile_rows).
constexpr int kTileRows = 64;

// Rank a tile's kTileRows rows by (key, row) (key INT_MAX: the row does not
// fold) into slots, and split the folding slots into segments of one key.
// Shared arrays: s_key [64] (input), s_part [4 * 64] (scratch), s_slot [64]
// (slot of each row), s_row [64] (row of each slot), s_seg [65] (first slot
// of each segment, then n_fold), s_misc [6]: [0] n_fold (slots [0, n_fold)
// fold), [1] the number of segments. Called by all 256 threads of the CTA
// after s_key is written and visible; ends with a barrier.
__device__ __forceinline__ void rank_tile_rows(const int* s_key, int* s_part, int* s_slot,
                                               int* s_row, int* s_seg, int* s_misc) {
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  {
    const int q = tid % kTileRows, part = tid / kTileRows;  // 4 threads a row, 16 rows each
    const int key = s_key[q];
    int rank = 0;
#pragma unroll
    for (int j = 0; j < kTileRows / 4; ++j) {
      const int o = part * (kTileRows / 4) + j, k = s_key[o];
      rank += (k < key || (k == key && o < q)) ? 1 : 0;
    }
    s_part[part * kTileRows + q] = rank;
  }
  __syncthreads();
  if (tid < kTileRows) {
    const int rank = s_part[tid] + s_part[kTileRows + tid] + s_part[2 * kTileRows + tid] +
                     s_part[3 * kTileRows + tid];
    s_slot[tid] = rank;
    s_row[rank] = tid;
  }
  __syncthreads();
  // segment starts among the folding slots, in slot order: warps 0 and 1
  // (one slot a thread) count them, then write them. Every barrier is the
  // CTA's: compute-sanitizer's racecheck reports the accesses after a named
  // barrier of part of the CTA as racing with those after the next
  // __syncthreads (docs/design.md, "Sanitizers").
  bool start = false;
  unsigned m = 0;
  if (w < 2) {
    const int key = s_key[s_row[tid]];
    start = key != INT_MAX && (tid == 0 || s_key[s_row[tid - 1]] != key);
    m = __ballot_sync(0xffffffffu, start);
    const unsigned live = __ballot_sync(0xffffffffu, key != INT_MAX);
    if (lane == 0) {
      s_misc[2 + w] = __popc(m);
      s_misc[4 + w] = __popc(live);
    }
  }
  __syncthreads();
  if (w < 2) {
    const int before = w == 0 ? 0 : s_misc[2];
    if (start) s_seg[before + __popc(m & ((1u << lane) - 1u))] = tid;
    if (tid == 0) {
      const int n_fold = s_misc[4] + s_misc[5];
      const int n_seg = s_misc[2] + s_misc[3];
      s_misc[0] = n_fold;
      s_misc[1] = n_seg;
      s_seg[n_seg] = n_fold;
    }
  }
  __syncthreads();
}

// Launch parameters of the grouped shrink kernel.
struct GroupedParams {
  GroupedArgs a;
  int e_eff;             // experts with tiles: min(table length, num_experts)
  int64_t rows_per_cta;  // rows of the window each CTA owns
};

// ------------------------------------------------------------- host --------

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
// Whether a gather fold's output buffers (out, and out2 when set) are aligned
// to `bytes` (a power of two).
inline bool outs_aligned(const GatherArgs& a, unsigned bytes) {
  const auto ok = [&](const void* p) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; };
  return ok(a.out) && (a.out2 == nullptr || ok(a.out2));
}

inline int sm_count() {
  static int n = [] {
    int dev = 0, v = 132;
    if (cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess)
      return v;
    return 132;
  }();
  return n;
}

// Raise a kernel's dynamic shared-memory limit to `smem_bytes` on the current
// device (a host-side attribute, no stream operation; cached per device).
inline cudaError_t ensure_smem(const void* kernel, int smem_bytes) {
  if (smem_bytes <= 48 * 1024) return cudaSuccess;
  static std::mutex mu;
  static std::unordered_map<const void*, int> raised[64];
  int dev = 0;
  if (const cudaError_t err = cudaGetDevice(&dev); err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  int& have = raised[dev & 63][kernel];
  if (smem_bytes > have) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return err;
    have = smem_bytes;
  }
  return cudaSuccess;
}

// Launch `kernel` with programmatic dependent launch when `pdl`: its CTAs
// may start while the previous kernel on the stream still runs, so the kernel
// must execute griddepcontrol.wait before it reads what that kernel writes.
// Without `pdl` it is an ordinary launch (griddepcontrol.wait returns at
// once): the folds' `pdl` attribute (jax_moelora/ops/launch.py).
template <class... Params, class... Args>
inline cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, int threads,
                                   int smem_bytes, cudaStream_t stream, bool pdl,
                                   const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads), 1, 1);
  cfg.dynamicSmemBytes = size_t(smem_bytes);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// Launchers of the kernel files (dtype already checked by the dispatchers).
cudaError_t launch_gather_f32(const GatherArgs& a, cudaStream_t stream);
cudaError_t launch_gather_rows(const GatherArgs& a, cudaStream_t stream);  // rows or staged rows
bool gather_rows_fits(const GatherArgs& a);  // shapes launch_gather_rows takes
cudaError_t launch_grouped_f32(const GroupedArgs& a, cudaStream_t stream);
// The grouped shrink (prefill_shrink.cu) writes xa for the expand
// (prefill_expand.cu); grouped_split_fits: the shapes both take.
cudaError_t launch_grouped_shrink(const GroupedArgs& a, cudaStream_t stream);
bool grouped_split_fits(const GroupedArgs& a);

}  // namespace fast
}  // namespace moelora
