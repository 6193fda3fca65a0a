// CUDA kernels of hybridrl::masked_whiten: (1) per-block partial masked sum and mask count,
// (2) one block folds the partials in a fixed order (deterministic for a given device), the host
// reads the two doubles (one sync, needed anyway for verl's ValueError on a mask summing to 0 or
// 1), (3) the same for the masked centered sum of squares, (4) one normalize pass. Statistics
// accumulate in double; the elementwise math is fp32 for fp32/bf16/fp16 and double for fp64.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>

#include "../common.h"
#include "cuda_utils.cuh"

namespace hybridrl {
namespace {

constexpr int kThreads = 256;

// Tree sum of x over the block; the result is valid in thread 0.
__device__ double block_sum(double x, double* shared) {
  shared[threadIdx.x] = x;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width >>= 1) {
    if (threadIdx.x < width) shared[threadIdx.x] += shared[threadIdx.x + width];
    __syncthreads();
  }
  const double total = shared[0];
  __syncthreads();
  return total;
}

// partials[block] = (sum m * v, sum m) if !centered, else (sum m * (v - mean)^2, 0).
template <typename scalar_t, bool centered>
__global__ void __launch_bounds__(kThreads)
whiten_partials(const scalar_t* __restrict__ v, const scalar_t* __restrict__ m, int64_t n,
                cuda_acc_t<scalar_t> mean, double* __restrict__ partials) {
  using acc_t = cuda_acc_t<scalar_t>;
  __shared__ double shared[kThreads];
  double x = 0.0, c = 0.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const acc_t mi = static_cast<acc_t>(m[i]);
    if (mi != acc_t(0)) {
      const acc_t vi = static_cast<acc_t>(v[i]);
      if constexpr (centered) {
        const acc_t d = vi - mean;
        x += static_cast<double>((d * d) * mi);
      } else {
        x += static_cast<double>(vi * mi);
      }
    }
    c += static_cast<double>(mi);
  }
  x = block_sum(x, shared);
  c = block_sum(c, shared);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = x;
    partials[2 * blockIdx.x + 1] = c;
  }
}

// out[0..1] = column sums of partials [count, 2], one block, fixed order.
__global__ void __launch_bounds__(kThreads)
fold_partials(const double* __restrict__ partials, int count, double* __restrict__ out) {
  __shared__ double shared[kThreads];
  double x = 0.0, c = 0.0;
  for (int i = threadIdx.x; i < count; i += kThreads) {
    x += partials[2 * i];
    c += partials[2 * i + 1];
  }
  x = block_sum(x, shared);
  c = block_sum(c, shared);
  if (threadIdx.x == 0) {
    out[0] = x;
    out[1] = c;
  }
}

template <typename scalar_t>
__global__ void whiten_normalize(const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                                 int64_t n, cuda_acc_t<scalar_t> mean,
                                 cuda_acc_t<scalar_t> rstd) {
  using acc_t = cuda_acc_t<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < n; i += stride) {
    out[i] = static_cast<scalar_t>((static_cast<acc_t>(v[i]) - mean) * rstd);
  }
}

// (sum, count) of the masked values (centered == false) or squares around mean (true).
template <typename scalar_t, bool centered>
std::pair<double, double> masked_stats(const at::Tensor& v, const at::Tensor& m,
                                       cuda_acc_t<scalar_t> mean) {
  const int64_t n = v.numel();
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, sm_count() * 4)));
  at::Tensor buf = at::empty({2 * blocks + 2}, v.options().dtype(at::kDouble));
  double* partials = buf.mutable_data_ptr<double>();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  whiten_partials<scalar_t, centered><<<blocks, kThreads, 0, stream>>>(
      v.const_data_ptr<scalar_t>(), m.const_data_ptr<scalar_t>(), n, mean, partials);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  fold_partials<<<1, kThreads, 0, stream>>>(partials, blocks, partials + 2 * blocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor host = buf.narrow(0, 2 * blocks, 2).cpu();  // syncs the stream
  return {host.const_data_ptr<double>()[0], host.const_data_ptr<double>()[1]};
}

at::Tensor masked_whiten_cuda(const at::Tensor& val_in, const at::Tensor& msk_in) {
  TORCH_CHECK_VALUE(val_in.sizes() == msk_in.sizes(), "mask must have the shape of values ",
                    val_in.sizes(), ", got ", msk_in.sizes());
  TORCH_CHECK_VALUE(val_in.scalar_type() == msk_in.scalar_type(),
                    "values and mask must share a floating dtype");
  TORCH_CHECK_VALUE(msk_in.device() == val_in.device(), "values and mask must be on one device");
  const c10::cuda::CUDAGuard guard(val_in.device());
  const at::Tensor val = val_in.contiguous(), msk = msk_in.contiguous();
  at::Tensor out = at::empty_like(val, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, val.scalar_type(), "whiten_cuda", [&] {
    using acc_t = cuda_acc_t<scalar_t>;
    const auto [sum, count] = masked_stats<scalar_t, false>(val, msk, acc_t(0));
    TORCH_CHECK_VALUE(count != 0.0, "mask: at least one element of the mask has to be 1");
    TORCH_CHECK_VALUE(count != 1.0,
                      "mask: the mask sums to one, the unbiased variance is undefined");
    const acc_t mean = static_cast<acc_t>(sum / (count + 1e-8));
    const double sq = masked_stats<scalar_t, true>(val, msk, mean).first;
    const double var = sq / (count + 1e-8) * (count / (count - 1.0));
    const acc_t rstd = static_cast<acc_t>(1.0 / std::sqrt(var + 1e-8));
    const int64_t n = val.numel();
    const int blocks = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, sm_count() * 32)));
    whiten_normalize<scalar_t><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        val.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), n, mean, rstd);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, CUDA, m) { m.impl("masked_whiten", &hybridrl::masked_whiten_cuda); }
