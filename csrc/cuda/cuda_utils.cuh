// Small helpers shared by the CUDA kernels. Only c10/cuda headers (no ATen/cuda, which pulls
// cuBLAS/cuSPARSE headers) so the .cu files also compile with a bare CUDA toolkit.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

namespace hybridrl {

template <typename scalar_t>
using cuda_acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Streaming multiprocessors of the current device.
inline int sm_count() {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount,
                                        c10::cuda::current_device()));
  return value;
}

}  // namespace hybridrl
