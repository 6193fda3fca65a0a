// CPU kernels of hybridrl::kl_forward / kl_backward: one fused pass over the flattened tensors,
// at::parallel_for over chunks, fp32 math for fp32/bf16/fp16 (bf16/fp16 widened per block into
// stack buffers), scalar double for fp64. The fp32/bf16/fp16 loops (kl_spans.h, explicit SIMD
// vectors) are compiled for AVX-512, AVX2 and the baseline ISA in this one translation unit
// (`#pragma GCC target`; the extension itself is built for the baseline), and the best path the
// CPU runs is picked at the first call; HYBRIDRL_CPU_ISA forces one, and the op kl_cpu_isa()
// names the path taken.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "../common.h"
#include "isa_select.h"

namespace hybridrl {
#if defined(__x86_64__) || defined(__i386__)
#define HR_X86 1
namespace isa_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
constexpr int kVecBytes = 64;
template <typename V> V max_ps(V a, V b) { return _mm512_max_ps(a, b); }
template <typename V> V min_ps(V a, V b) { return _mm512_min_ps(a, b); }
constexpr int64_t kHalfLanes = 16;
inline void widen_half(const c10::Half* src, float* dst) {
  _mm512_storeu_ps(dst, _mm512_maskz_cvtph_ps(  // maskz: GCC 12 warns on the plain form
      0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
}
inline void narrow_half(const float* src, c10::Half* dst) {
  const __m256i h = _mm512_maskz_cvtps_ph(0xFFFF, _mm512_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
}
#include "kl_spans.h"
#pragma GCC pop_options
}  // namespace isa_avx512
namespace isa_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
constexpr int kVecBytes = 32;
template <typename V> V max_ps(V a, V b) { return _mm256_max_ps(a, b); }
template <typename V> V min_ps(V a, V b) { return _mm256_min_ps(a, b); }
constexpr int64_t kHalfLanes = 8;
inline void widen_half(const c10::Half* src, float* dst) {
  _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}
inline void narrow_half(const float* src, c10::Half* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm256_cvtps_ph(_mm256_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT));
}
#include "kl_spans.h"
#pragma GCC pop_options
}  // namespace isa_avx2
#endif
namespace isa_base {  // the build's baseline ISA: SSE2 on x86-64, NEON on aarch64
constexpr int kVecBytes = 16;
#ifdef HR_X86
template <typename V> V max_ps(V a, V b) { return _mm_max_ps(a, b); }
template <typename V> V min_ps(V a, V b) { return _mm_min_ps(a, b); }
#else
template <typename V> V max_ps(V a, V b) { return a > b ? a : b; }
template <typename V> V min_ps(V a, V b) { return a < b ? a : b; }
#endif
constexpr int64_t kHalfLanes = 1;  // c10's scalar conversion
inline void widen_half(const c10::Half* src, float* dst) { *dst = static_cast<float>(*src); }
inline void narrow_half(const float* src, c10::Half* dst) { *dst = static_cast<c10::Half>(*src); }
#include "kl_spans.h"
}  // namespace isa_base

namespace {

template <typename scalar_t>
using SpanFn = void (*)(int64_t, const scalar_t*, const scalar_t*, const scalar_t*, scalar_t*,
                        int64_t);

// One ISA's loops: out = f(grad?, lp, ref) over n contiguous elements (grad null: forward).
struct IsaPath {
  const char* name;
  SpanFn<float> f32;
  SpanFn<c10::BFloat16> bf16;
  SpanFn<c10::Half> f16;
};

#define HR_ISA_PATH(name, ns) IsaPath{name, &ns::kl_span, &ns::kl_span_bf16, &ns::kl_span_half}

// The paths this CPU can run, best first; the baseline is always last.
std::vector<IsaPath> available_paths() {
  std::vector<IsaPath> paths;
#ifdef HR_X86
  const isa_select::SimdLevels cpu = isa_select::cpu_simd_levels();
  if (cpu.avx512) paths.push_back(HR_ISA_PATH("avx512", isa_avx512));
  if (cpu.avx2) paths.push_back(HR_ISA_PATH("avx2", isa_avx2));
#endif
  paths.push_back(HR_ISA_PATH("baseline", isa_base));
  return paths;
}

// HYBRIDRL_CPU_ISA (read once, at the first KL call): unset/"auto" takes the best path, a
// path's name forces it; a name this CPU cannot run raises ValueError naming the ones it can.
IsaPath choose_path() {
  return isa_select::pick_isa_path(available_paths(), isa_select::isa_env(), "HYBRIDRL_CPU_ISA=",
                                   "a KL");
}

const IsaPath& isa_path() {
  static const IsaPath path = choose_path();
  return path;
}

constexpr int64_t kGrain = 1 << 15;  // elements per parallel task

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
void kl_range(const IsaPath& path, int64_t kind, const scalar_t* g, const scalar_t* p,
              const scalar_t* r, scalar_t* o, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    kl_double_any(kind, g, p, r, o, begin, end);
  } else {
    SpanFn<scalar_t> span;
    if constexpr (std::is_same_v<scalar_t, float>) span = path.f32;
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) span = path.bf16;
    if constexpr (std::is_same_v<scalar_t, c10::Half>) span = path.f16;
    span(kind, g ? g + begin : nullptr, p + begin, r + begin, o + begin, end - begin);
  }
}

// Shared driver: grad undefined -> forward.
at::Tensor kl_apply(const at::Tensor& grad_in, const at::Tensor& lp_in, const at::Tensor& ref_in,
                    int64_t kind) {
  check_inputs(lp_in, ref_in, kind);
  const at::Tensor lp = lp_in.contiguous(), ref = ref_in.contiguous();
  const at::Tensor grad = grad_in.defined() ? grad_in.to(lp.scalar_type()).contiguous() : grad_in;
  at::Tensor out = at::empty_like(lp, at::MemoryFormat::Contiguous);
  const IsaPath& path = isa_path();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, lp.scalar_type(), "kl_cpu", [&] {
    const scalar_t* g = grad.defined() ? grad.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* p = lp.const_data_ptr<scalar_t>();
    const scalar_t* r = ref.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, lp.numel(), kGrain, [&](int64_t begin, int64_t end) {
      kl_range<scalar_t>(path, kind, g, p, r, o, begin, end);
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

// Name of the float path the KL kernels run ("avx512", "avx2", "baseline"): op kl_cpu_isa.
std::string kl_cpu_isa() { return isa_path().name; }

}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, CPU, m) {
  m.impl("kl_forward", &hybridrl::kl_forward_cpu);
  m.impl("kl_backward", &hybridrl::kl_backward_cpu);
}
