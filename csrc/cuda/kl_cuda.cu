// CUDA kernels of hybridrl::kl_forward / kl_backward: one fused elementwise pass (grid-stride,
// kUnroll independent elements per thread per iteration for memory-level parallelism), fp32 math
// for fp32/bf16/fp16 and double for fp64. Formulas: csrc/common.h (expf, not __expf; the build
// passes --fmad=false so products are rounded like the reference's separate torch ops).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../common.h"
#include "cuda_utils.cuh"

namespace hybridrl {
namespace {

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// out[i] = kl_value or kl_grad (grad != nullptr) over n elements.
template <typename scalar_t, int64_t KIND>
__global__ void kl_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ lp,
                          const scalar_t* __restrict__ ref, scalar_t* __restrict__ out,
                          int64_t n) {
  using acc_t = acc_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x;
       base < n; base += stride) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < n) {
        const acc_t p = static_cast<acc_t>(lp[i]), r = static_cast<acc_t>(ref[i]);
        const acc_t y = grad ? kl_grad<KIND, acc_t>(static_cast<acc_t>(grad[i]), p, r)
                             : kl_value<KIND, acc_t>(p, r);
        out[i] = static_cast<scalar_t>(y);
      }
    }
  }
}

template <typename scalar_t, int64_t KIND>
void launch(const scalar_t* g, const scalar_t* p, const scalar_t* r, scalar_t* o, int64_t n) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * kUnroll;
  const int sms = sm_count();
  const int64_t blocks = std::min<int64_t>((n + per_block - 1) / per_block, int64_t(sms) * 32);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  kl_kernel<scalar_t, KIND><<<blocks, kThreads, 0, stream>>>(g, p, r, o, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor kl_apply_cuda(const at::Tensor& grad_in, const at::Tensor& lp_in,
                         const at::Tensor& ref_in, int64_t kind) {
  TORCH_CHECK_VALUE(kind >= kK1 && kind <= kK3, "kind must be in [0, 3], got ", kind);
  TORCH_CHECK_VALUE(lp_in.sizes() == ref_in.sizes(), "ref_logprob must have the shape of logprob");
  TORCH_CHECK_VALUE(lp_in.scalar_type() == ref_in.scalar_type(),
                    "logprob and ref_logprob must share a dtype");
  TORCH_CHECK_VALUE(ref_in.device() == lp_in.device() &&
                        (!grad_in.defined() || grad_in.device() == lp_in.device()),
                    "logprob, ref_logprob (and grad) must be on one device");
  const c10::cuda::CUDAGuard guard(lp_in.device());
  const at::Tensor lp = lp_in.contiguous(), ref = ref_in.contiguous();
  const at::Tensor grad = grad_in.defined() ? grad_in.to(lp.scalar_type()).contiguous() : grad_in;
  at::Tensor out = at::empty_like(lp, at::MemoryFormat::Contiguous);
  const int64_t n = lp.numel();
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, lp.scalar_type(), "kl_cuda", [&] {
    const scalar_t* g = grad.defined() ? grad.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* p = lp.const_data_ptr<scalar_t>();
    const scalar_t* r = ref.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    switch (kind) {
      case kK1: launch<scalar_t, kK1>(g, p, r, o, n); break;
      case kAbs: launch<scalar_t, kAbs>(g, p, r, o, n); break;
      case kK2: launch<scalar_t, kK2>(g, p, r, o, n); break;
      default: launch<scalar_t, kK3>(g, p, r, o, n); break;
    }
  });
  return out;
}

at::Tensor kl_forward_cuda(const at::Tensor& lp, const at::Tensor& ref, int64_t fwd_kind,
                           int64_t bwd_kind) {
  TORCH_CHECK_VALUE(bwd_kind >= kK1 && bwd_kind <= kK3, "bwd_kind must be in [0, 3]");
  return kl_apply_cuda(at::Tensor(), lp, ref, fwd_kind);
}

at::Tensor kl_backward_cuda(const at::Tensor& grad, const at::Tensor& lp, const at::Tensor& ref,
                            int64_t bwd_kind) {
  TORCH_CHECK_VALUE(grad.sizes() == lp.sizes(), "grad must have the shape of logprob");
  return kl_apply_cuda(grad, lp, ref, bwd_kind);
}

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, CUDA, m) {
  m.impl("kl_forward", &hybridrl::kl_forward_cuda);
  m.impl("kl_backward", &hybridrl::kl_backward_cuda);
}
