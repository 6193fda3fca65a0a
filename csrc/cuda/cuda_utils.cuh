// Small helpers shared by the CUDA kernels. Only c10/cuda headers (no ATen/cuda, which pulls
// cuBLAS/cuSPARSE headers) so the .cu files also compile with a bare CUDA toolkit.
#pragma once

#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <vector>

namespace hybridrl {

template <typename scalar_t>
using cuda_acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Streaming multiprocessors of CUDA device `device`, queried once per process for all devices
// (a thread-safe function-local static), not on every launch.
inline int sm_count(c10::DeviceIndex device) {
  static const std::vector<int> counts = [] {
    std::vector<int> out(static_cast<size_t>(c10::cuda::device_count()), 0);
    for (size_t i = 0; i < out.size(); ++i) {
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&out[i], cudaDevAttrMultiProcessorCount,
                                            static_cast<int>(i)));
    }
    return out;
  }();
  TORCH_CHECK(device >= 0 && static_cast<size_t>(device) < counts.size(), "no CUDA device ",
              static_cast<int>(device));
  return counts[static_cast<size_t>(device)];
}

}  // namespace hybridrl
