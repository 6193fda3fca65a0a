// CUDA kernels of hybridrl::masked_whiten, statistics kept on the device (no host round trip
// between passes, so the op can be captured into a CUDA graph):
//   (1) per-block partial masked sum and mask count;  (2) one block folds them in a fixed order
//   (deterministic for a given device) and writes N, mean;  (3) per-block partial masked
//   centered sums of squares around that mean;  (4) one block folds them and writes rstd;
//   (5) one normalize pass reading mean and rstd from the device.
// Statistics accumulate in double; the elementwise math is fp32 for fp32/bf16/fp16 and double
// for fp64. verl raises ValueError when the mask sums to 0 or 1: outside graph capture the op
// reads N once, after all five launches are queued (the GPU does not wait on the host between
// passes), and raises; under capture no host read is possible, so the output is NaN instead
// (rstd = NaN when N <= 1), documented in docs/kernels.md.
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
constexpr double kWhitenEps = 1e-8;
// Device statistics, doubles: [0] masked sum, [1] N, [2] mean (rounded to acc_t), [3] centered
// sum of squares, [4] rstd (rounded to acc_t; NaN when N <= 1).
enum Stat { kSum = 0, kCount = 1, kMean = 2, kSquares = 3, kRstd = 4, kStats = 5 };

// Tree sum of x over the block; the result is valid in every thread.
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

// partials[block] = (sum m * v, sum m) if !centered, else (sum m * (v - mean)^2, 0) with the
// mean read from stats[kMean].
template <typename scalar_t, bool centered>
__global__ void __launch_bounds__(kThreads)
whiten_partials(const scalar_t* __restrict__ v, const scalar_t* __restrict__ m, int64_t n,
                const double* __restrict__ stats, double* __restrict__ partials) {
  using acc_t = cuda_acc_t<scalar_t>;
  __shared__ double shared[kThreads];
  const acc_t mean = centered ? static_cast<acc_t>(stats[kMean]) : acc_t(0);
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

// Folds partials [count, 2] in a fixed order (one block). First fold: stats[kSum], [kCount],
// [kMean]; second fold (centered): stats[kSquares], [kRstd] (mean and rstd rounded to acc_t).
template <typename acc_t, bool centered>
__global__ void __launch_bounds__(kThreads)
fold_partials(const double* __restrict__ partials, int count, double* __restrict__ stats) {
  __shared__ double shared[kThreads];
  double x = 0.0, c = 0.0;
  for (int i = threadIdx.x; i < count; i += kThreads) {
    x += partials[2 * i];
    c += partials[2 * i + 1];
  }
  x = block_sum(x, shared);
  c = block_sum(c, shared);
  if (threadIdx.x != 0) return;
  if constexpr (!centered) {
    stats[kSum] = x;
    stats[kCount] = c;
    stats[kMean] = static_cast<double>(static_cast<acc_t>(x / (c + kWhitenEps)));
  } else {
    const double n = stats[kCount];
    const double var = x / (n + kWhitenEps) * (n / (n - 1.0));
    stats[kSquares] = x;
    stats[kRstd] = n == 0.0 || n == 1.0
                       ? nan("")
                       : static_cast<double>(static_cast<acc_t>(1.0 / sqrt(var + kWhitenEps)));
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
whiten_normalize(const scalar_t* __restrict__ v, scalar_t* __restrict__ out, int64_t n,
                 const double* __restrict__ stats) {
  using acc_t = cuda_acc_t<scalar_t>;
  const acc_t mean = static_cast<acc_t>(stats[kMean]), rstd = static_cast<acc_t>(stats[kRstd]);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    out[i] = static_cast<scalar_t>((static_cast<acc_t>(v[i]) - mean) * rstd);
  }
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
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
  const int64_t n = val.numel();
  const int sms = sm_count(val.get_device());
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(sms) * 4)));
  at::Tensor buf = at::empty({2 * blocks + kStats}, val.options().dtype(at::kDouble));
  double* partials = buf.mutable_data_ptr<double>();
  double* stats = partials + 2 * blocks;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, val.scalar_type(), "whiten_cuda", [&] {
    using acc_t = cuda_acc_t<scalar_t>;
    const scalar_t* v = val.const_data_ptr<scalar_t>();
    const scalar_t* m = msk.const_data_ptr<scalar_t>();
    whiten_partials<scalar_t, false><<<blocks, kThreads, 0, stream>>>(v, m, n, stats, partials);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    fold_partials<acc_t, false><<<1, kThreads, 0, stream>>>(partials, blocks, stats);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    whiten_partials<scalar_t, true><<<blocks, kThreads, 0, stream>>>(v, m, n, stats, partials);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    fold_partials<acc_t, true><<<1, kThreads, 0, stream>>>(partials, blocks, stats);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int norm_blocks = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(sms) * 8)));
    whiten_normalize<scalar_t><<<norm_blocks, kThreads, 0, stream>>>(
        v, out.mutable_data_ptr<scalar_t>(), n, stats);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!stream_is_capturing(stream)) {  // verl's ValueError; one read after all work is queued
    const double count = buf.narrow(0, 2 * blocks + kCount, 1).item<double>();
    TORCH_CHECK_VALUE(count != 0.0, "mask: at least one element of the mask has to be 1");
    TORCH_CHECK_VALUE(count != 1.0,
                      "mask: the mask sums to one, the unbiased variance is undefined");
  }
  return out;
}

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, CUDA, m) { m.impl("masked_whiten", &hybridrl::masked_whiten_cuda); }
