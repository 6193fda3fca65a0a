// CUDA kernels of hybridrl::kl_forward / kl_backward: one fused elementwise pass, fp32 math for
// fp32/bf16/fp16 and double for fp64. Formulas: csrc/common.h (expf, not __expf; the build
// passes --fmad=false so products are rounded like the reference's separate torch ops); the
// "+" kinds' forward is kl_value<kind | kStraight> (verl's NaN where 0.5 d^2 overflows).
// Memory access: 16-byte vector loads and stores (8 bf16/fp16, 4 fp32, 2 fp64 per access),
// kUnroll independent vectors per thread per grid-stride iteration, at most kBlocksPerSm
// resident blocks' worth of grid (the grid-stride loop covers larger tensors). An input whose
// storage is not 16-byte aligned (a contiguous view at an odd offset) is copied first. The last
// n mod (elements per vector) elements are done by block 0, one per thread.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../common.h"
#include "cuda_utils.cuh"

namespace hybridrl {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 2;
constexpr int kBlocksPerSm = 8;  // 2048 resident threads per SM on sm_80/sm_90
constexpr int kVecBytes = 16;

template <typename scalar_t>
struct alignas(kVecBytes) Vec {
  static constexpr int kSize = kVecBytes / static_cast<int>(sizeof(scalar_t));
  scalar_t v[kSize];
};

// One element: the value of kernel code KIND, or (kBackward) grad * d/d(logprob) of estimator
// KIND.
template <typename scalar_t, int64_t KIND, bool kBackward>
__device__ __forceinline__ scalar_t kl_one(scalar_t g, scalar_t p, scalar_t r) {
  using acc_t = cuda_acc_t<scalar_t>;
  const acc_t pa = static_cast<acc_t>(p), ra = static_cast<acc_t>(r);
  if constexpr (kBackward) {
    return static_cast<scalar_t>(kl_grad<KIND, acc_t>(static_cast<acc_t>(g), pa, ra));
  } else {
    return static_cast<scalar_t>(kl_value<KIND, acc_t>(pa, ra));
  }
}

// out = kl_one(grad, lp, ref) over n elements; pointers 16-byte aligned.
template <typename scalar_t, int64_t KIND, bool kBackward>
__global__ void __launch_bounds__(kThreads)
kl_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ lp,
          const scalar_t* __restrict__ ref, scalar_t* __restrict__ out, int64_t n) {
  using V = Vec<scalar_t>;
  constexpr int kSize = V::kSize;
  const int64_t n_vec = n / kSize;
  const V* lp_v = reinterpret_cast<const V*>(lp);
  const V* ref_v = reinterpret_cast<const V*>(ref);
  const V* grad_v = reinterpret_cast<const V*>(grad);
  V* out_v = reinterpret_cast<V*>(out);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads * kUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x;
       base < n_vec; base += stride) {
    V p[kUnroll], r[kUnroll], g[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll * 2-3 in flight
      const int64_t i = base + static_cast<int64_t>(u) * kThreads;
      if (i < n_vec) {
        p[u] = lp_v[i];
        r[u] = ref_v[i];
        if constexpr (kBackward) g[u] = grad_v[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kThreads;
      if (i < n_vec) {
        V o;
#pragma unroll
        for (int j = 0; j < kSize; ++j) {
          o.v[j] = kl_one<scalar_t, KIND, kBackward>(kBackward ? g[u].v[j] : scalar_t(0),
                                                     p[u].v[j], r[u].v[j]);
        }
        out_v[i] = o;
      }
    }
  }
  const int64_t tail = n - n_vec * kSize;  // < kSize elements
  if (blockIdx.x == 0 && threadIdx.x < tail) {
    const int64_t i = n_vec * kSize + threadIdx.x;
    out[i] = kl_one<scalar_t, KIND, kBackward>(kBackward ? grad[i] : scalar_t(0), lp[i], ref[i]);
  }
}

template <typename scalar_t, int64_t KIND, bool kBackward>
void launch(const scalar_t* g, const scalar_t* p, const scalar_t* r, scalar_t* o, int64_t n,
            int sms) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * kUnroll * Vec<scalar_t>::kSize;
  const int64_t blocks =
      std::max<int64_t>(1, std::min<int64_t>((n + per_block - 1) / per_block,
                                             int64_t(sms) * kBlocksPerSm));
  kl_kernel<scalar_t, KIND, kBackward>
      <<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          g, p, r, o, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned(const at::Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % kVecBytes == 0;
}

// Contiguous and 16-byte aligned (a copy when the storage offset breaks the alignment).
at::Tensor vector_ready(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return aligned(c) ? c : c.clone(at::MemoryFormat::Contiguous);
}

// Forward (grad undefined; code = kernel code incl. kStraight) or backward (code = bwd kind).
at::Tensor kl_apply_cuda(const at::Tensor& grad_in, const at::Tensor& lp_in,
                         const at::Tensor& ref_in, int64_t code) {
  TORCH_CHECK_VALUE(lp_in.sizes() == ref_in.sizes(), "ref_logprob must have the shape of logprob");
  TORCH_CHECK_VALUE(lp_in.scalar_type() == ref_in.scalar_type(),
                    "logprob and ref_logprob must share a dtype");
  TORCH_CHECK_VALUE(ref_in.device() == lp_in.device() &&
                        (!grad_in.defined() || grad_in.device() == lp_in.device()),
                    "logprob, ref_logprob (and grad) must be on one device");
  const c10::cuda::CUDAGuard guard(lp_in.device());
  const at::Tensor lp = vector_ready(lp_in), ref = vector_ready(ref_in);
  const at::Tensor grad =
      grad_in.defined() ? vector_ready(grad_in.to(lp.scalar_type())) : grad_in;
  at::Tensor out = at::empty_like(lp, at::MemoryFormat::Contiguous);
  const int64_t n = lp.numel();
  if (n == 0) return out;
  TORCH_INTERNAL_ASSERT(aligned(out), "kl_cuda: the output is not 16-byte aligned");
  const int sms = sm_count(lp.get_device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, lp.scalar_type(), "kl_cuda", [&] {
    const scalar_t* p = lp.const_data_ptr<scalar_t>();
    const scalar_t* r = ref.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    if (grad.defined()) {
      const scalar_t* g = grad.const_data_ptr<scalar_t>();
      switch (code) {
        case kK1: return launch<scalar_t, kK1, true>(g, p, r, o, n, sms);
        case kAbs: return launch<scalar_t, kAbs, true>(g, p, r, o, n, sms);
        case kK2: return launch<scalar_t, kK2, true>(g, p, r, o, n, sms);
        default: return launch<scalar_t, kK3, true>(g, p, r, o, n, sms);
      }
    }
    switch (code) {
      case kK1: return launch<scalar_t, kK1, false>(nullptr, p, r, o, n, sms);
      case kAbs: return launch<scalar_t, kAbs, false>(nullptr, p, r, o, n, sms);
      case kK2: return launch<scalar_t, kK2, false>(nullptr, p, r, o, n, sms);
      case kK3: return launch<scalar_t, kK3, false>(nullptr, p, r, o, n, sms);
      case kK1 | kStraight:
        return launch<scalar_t, kK1 | kStraight, false>(nullptr, p, r, o, n, sms);
      case kAbs | kStraight:
        return launch<scalar_t, kAbs | kStraight, false>(nullptr, p, r, o, n, sms);
      default: return launch<scalar_t, kK3 | kStraight, false>(nullptr, p, r, o, n, sms);
    }
  });
  return out;
}

at::Tensor kl_forward_cuda(const at::Tensor& lp, const at::Tensor& ref, int64_t fwd_kind,
                           int64_t bwd_kind) {
  TORCH_CHECK_VALUE(fwd_kind >= kK1 && fwd_kind <= kK3, "fwd_kind must be in [0, 3], got ",
                    fwd_kind);
  TORCH_CHECK_VALUE(bwd_kind == fwd_kind || bwd_kind == kK2,
                    "bwd_kind must equal fwd_kind or be 2 (k2, the straight-through kinds)");
  return kl_apply_cuda(at::Tensor(), lp, ref, kl_forward_code(fwd_kind, bwd_kind));
}

at::Tensor kl_backward_cuda(const at::Tensor& grad, const at::Tensor& lp, const at::Tensor& ref,
                            int64_t bwd_kind) {
  TORCH_CHECK_VALUE(grad.sizes() == lp.sizes(), "grad must have the shape of logprob");
  TORCH_CHECK_VALUE(bwd_kind >= kK1 && bwd_kind <= kK3, "bwd_kind must be in [0, 3], got ",
                    bwd_kind);
  return kl_apply_cuda(grad, lp, ref, bwd_kind);
}

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, CUDA, m) {
  m.impl("kl_forward", &hybridrl::kl_forward_cuda);
  m.impl("kl_backward", &hybridrl::kl_backward_cuda);
}
