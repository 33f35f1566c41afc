// Writes that compute-sanitizer's initcheck cannot see, told to it through
// the NVTX memory API (header-only; each call returns at once when no tool
// is attached). initcheck does not count the CUTLASS GEMM's TMA stores
// (cp.async.bulk.tensor) as writes, and it reports the `tensormap.cp_fenceproxy`
// copy of a tensor map from shared memory into the GEMM's workspace as a read
// of global memory; expert_matmul marks both buffers (expert_matmul_impl.cuh).
// A mark is recorded when the handler runs: inside a CUDA graph it is seen at
// capture only, so the sanitizer runs keep XLA's command buffers off.
#pragma once

#include <cuda_runtime.h>
#include <nvtx3/nvToolsExtMemCudaRt.h>

#include <cstddef>

namespace moelora {

// `bytes` at `ptr` count as initialised from this point of `stream` on.
inline void mark_initialized(const void* ptr, size_t bytes, cudaStream_t stream) {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("jax_moelora");
  const nvtxMemVirtualRangeDesc_t range{bytes, ptr};
  nvtxMemMarkInitializedBatch_t batch{};
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof(batch);
  batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  batch.regionDescCount = 1;
  batch.regionDescElementSize = sizeof(range);
  batch.regionDescElements = &range;
  nvtxMemCudaMarkInitialized(domain, stream, 0, &batch);
}

}  // namespace moelora
