// CPU kernels of hybridrl::kl_forward / kl_backward: one fused pass over the flattened tensors,
// at::parallel_for over chunks, fp32 math for fp32/bf16/fp16 (bf16/fp16 converted per block of
// kBlock elements into stack buffers), double for fp64. The float loops are compiled for
// AVX-512, AVX2 and the baseline ISA and picked at run time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "../common.h"

namespace hybridrl {
namespace isa_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")
#include "kl_spans.h"
#pragma GCC pop_options
}  // namespace isa_avx512
namespace isa_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "kl_spans.h"
#pragma GCC pop_options
}  // namespace isa_avx2
namespace isa_base {
#include "kl_spans.h"
}  // namespace isa_base

namespace {

using SpanFn = void (*)(int64_t, const float*, const float*, const float*, float*, int64_t);

SpanFn pick_span() {
  static const SpanFn fn = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
      return &isa_avx512::kl_span;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &isa_avx2::kl_span;
    return &isa_base::kl_span;
  }();
  return fn;
}

constexpr int64_t kBlock = 1024;     // elements converted at a time for bf16/fp16
constexpr int64_t kGrain = 1 << 15;  // elements per parallel task

// out[i] = f(grad[i]?, lp[i], ref[i]) over [begin, end) for a reduced-precision scalar_t.
template <typename scalar_t>
void kl_block_lowp(SpanFn span, int64_t kind, const scalar_t* grad, const scalar_t* lp,
                   const scalar_t* ref, scalar_t* out, int64_t begin, int64_t end) {
  float g_buf[kBlock], lp_buf[kBlock], ref_buf[kBlock], out_buf[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    for (int64_t i = 0; i < n; ++i) {
      lp_buf[i] = static_cast<float>(lp[b + i]);
      ref_buf[i] = static_cast<float>(ref[b + i]);
      if (grad) g_buf[i] = static_cast<float>(grad[b + i]);
    }
    span(kind, grad ? g_buf : nullptr, lp_buf, ref_buf, out_buf, n);
    for (int64_t i = 0; i < n; ++i) out[b + i] = static_cast<scalar_t>(out_buf[i]);
  }
}

template <int64_t KIND>
void kl_double(const double* grad, const double* lp, const double* ref, double* out,
               int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    out[i] = grad ? kl_grad<KIND, double>(grad[i], lp[i], ref[i])
                  : kl_value<KIND, double>(lp[i], ref[i]);
  }
}

void kl_double_any(int64_t kind, const double* grad, const double* lp, const double* ref,
                   double* out, int64_t begin, int64_t end) {
  switch (kind) {
    case kK1: return kl_double<kK1>(grad, lp, ref, out, begin, end);
    case kAbs: return kl_double<kAbs>(grad, lp, ref, out, begin, end);
    case kK2: return kl_double<kK2>(grad, lp, ref, out, begin, end);
    case kK1 | kStraight: return kl_double<kK1 | kStraight>(grad, lp, ref, out, begin, end);
    case kAbs | kStraight: return kl_double<kAbs | kStraight>(grad, lp, ref, out, begin, end);
    case kK3 | kStraight: return kl_double<kK3 | kStraight>(grad, lp, ref, out, begin, end);
    default: return kl_double<kK3>(grad, lp, ref, out, begin, end);
  }
}

void check_inputs(const at::Tensor& lp, const at::Tensor& ref, int64_t kind) {
  TORCH_CHECK_VALUE(kind >= kK1 && kind <= (kK3 | kStraight), "kernel code must be in [0, 7], "
                    "got ", kind);
  TORCH_CHECK_VALUE(lp.sizes() == ref.sizes(), "ref_logprob must have the shape of logprob ",
                    lp.sizes(), ", got ", ref.sizes());
  TORCH_CHECK_VALUE(lp.scalar_type() == ref.scalar_type(),
                    "logprob and ref_logprob must share a dtype");
}

// out = f(grad?, lp, ref) over elements [begin, end) of one dtype.
template <typename scalar_t>
void kl_range(SpanFn span, int64_t kind, const scalar_t* g, const scalar_t* p, const scalar_t* r,
              scalar_t* o, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    span(kind, g ? g + begin : nullptr, p + begin, r + begin, o + begin, end - begin);
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    kl_double_any(kind, g, p, r, o, begin, end);
  } else {
    kl_block_lowp<scalar_t>(span, kind, g, p, r, o, begin, end);
  }
}

// Shared driver: grad undefined -> forward.
at::Tensor kl_apply(const at::Tensor& grad_in, const at::Tensor& lp_in, const at::Tensor& ref_in,
                    int64_t kind) {
  check_inputs(lp_in, ref_in, kind);
  const at::Tensor lp = lp_in.contiguous(), ref = ref_in.contiguous();
  const at::Tensor grad = grad_in.defined() ? grad_in.to(lp.scalar_type()).contiguous() : grad_in;
  at::Tensor out = at::empty_like(lp, at::MemoryFormat::Contiguous);
  const SpanFn span = pick_span();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, lp.scalar_type(), "kl_cpu", [&] {
    const scalar_t* g = grad.defined() ? grad.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* p = lp.const_data_ptr<scalar_t>();
    const scalar_t* r = ref.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, lp.numel(), kGrain, [&](int64_t begin, int64_t end) {
      kl_range<scalar_t>(span, kind, g, p, r, o, begin, end);
    });
  });
  return out;
}

at::Tensor kl_forward_cpu(const at::Tensor& lp, const at::Tensor& ref, int64_t fwd_kind,
                          int64_t bwd_kind) {
  TORCH_CHECK_VALUE(fwd_kind >= kK1 && fwd_kind <= kK3, "fwd_kind must be in [0, 3]");
  TORCH_CHECK_VALUE(bwd_kind == fwd_kind || bwd_kind == kK2,
                    "bwd_kind must equal fwd_kind or be 2 (k2, the straight-through kinds)");
  return kl_apply(at::Tensor(), lp, ref, kl_forward_code(fwd_kind, bwd_kind));
}

at::Tensor kl_backward_cpu(const at::Tensor& grad, const at::Tensor& lp, const at::Tensor& ref,
                           int64_t bwd_kind) {
  TORCH_CHECK_VALUE(grad.sizes() == lp.sizes(), "grad must have the shape of logprob");
  TORCH_CHECK_VALUE(bwd_kind >= kK1 && bwd_kind <= kK3, "bwd_kind must be in [0, 3]");
  return kl_apply(grad, lp, ref, bwd_kind);
}

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, CPU, m) {
  m.impl("kl_forward", &hybridrl::kl_forward_cpu);
  m.impl("kl_backward", &hybridrl::kl_backward_cpu);
}
