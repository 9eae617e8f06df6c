// Shared helpers for dsfunc's CUDA kernels: argument checks and launch geometry.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsfunc {

// Number of multiprocessors of the current device, read once per device.
inline int sm_count() {
  static int cached[64] = {0};
  int dev = c10::cuda::current_device();
  if (dev < 64 && cached[dev] > 0) return cached[dev];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (dev < 64) cached[dev] = n;
  return n;
}

// How many blocks of `threads` threads of `kernel` one multiprocessor holds at once.
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  return per_sm > 0 ? per_sm : 1;
}

inline bool aligned_to(const void* ptr, std::uintptr_t bytes) {
  return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
}

}  // namespace dsfunc
