// CPU kernels of the fused gated-MLP activation (SwiGLU) and rotary embedding (RoPE), forward and
// backward, with their op schemas (a TORCH_LIBRARY_FRAGMENT of hybridrl):
//   swiglu_fwd(x [..., 2f]) -> [..., f]            silu(x[..., :f]) * x[..., f:]  (megatron's
//                                                  gate|up halves of fc1)
//   swiglu_bwd(grad [..., f], x [..., 2f]) -> [..., 2f]   (d gate | d up)
//   rope_fwd(x [t, ..., d], cos, sin) -> [t, ..., d]    x * cos + rotate_half(x) * sin
//   rope_bwd(grad [t, ..., d], cos, sin) -> [t, ..., d] its transpose (the gradient of x)
//   swiglu_cpu_isa() -> str                         the SIMD path these kernels run
// cos/sin have x's rank, last dim d (even), size 1 in every middle dim and size t or 1 in dim 0
// (megatron's per-token rotary table, gathered per position for a pack); x may be strided
// (the q/k heads sliced out of the fused QKV projection) as long as its last dim is contiguous;
// outputs are contiguous. fp32, bf16 and fp16 (bf16/fp16 widened to fp32 per row, rounded once);
// the Python wrapper (hybridrl/kernels/swiglu.py) runs eager torch for fp64 and other devices.
// Loops: swiglu_spans.h, compiled for AVX-512, AVX2 and the baseline ISA as kl_cpu.cpp does; the
// path is picked at the first call, HYBRIDRL_CPU_ISA forces one.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "../common.h"
#include "isa_select.h"

namespace hybridrl {
namespace {  // internal linkage: no symbol shared with kl_cpu.cpp's ISA namespaces
#if defined(__x86_64__) || defined(__i386__)
#define HR_ACT_X86 1
namespace act_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
constexpr int kVecBytes = 64;
constexpr int64_t kHalfLanes = 16;
inline void widen_half(const c10::Half* src, float* dst) {
  _mm512_storeu_ps(dst, _mm512_maskz_cvtph_ps(
      0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
}
inline void narrow_half(const float* src, c10::Half* dst) {
  const __m256i h = _mm512_maskz_cvtps_ph(0xFFFF, _mm512_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
}
#include "swiglu_spans.h"
#pragma GCC pop_options
}  // namespace act_avx512
namespace act_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
constexpr int kVecBytes = 32;
constexpr int64_t kHalfLanes = 8;
inline void widen_half(const c10::Half* src, float* dst) {
  _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}
inline void narrow_half(const float* src, c10::Half* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm256_cvtps_ph(_mm256_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT));
}
#include "swiglu_spans.h"
#pragma GCC pop_options
}  // namespace act_avx2
#endif
namespace act_base {  // the build's baseline ISA: SSE2 on x86-64, NEON on aarch64
constexpr int kVecBytes = 16;
constexpr int64_t kHalfLanes = 1;  // c10's scalar conversion
inline void widen_half(const c10::Half* src, float* dst) { *dst = static_cast<float>(*src); }
inline void narrow_half(const float* src, c10::Half* dst) { *dst = static_cast<c10::Half>(*src); }
#include "swiglu_spans.h"
}  // namespace act_base

template <typename T>
using SwigluFn = void (*)(const T*, const T*, T*, int64_t, int64_t, int64_t);
template <typename T>
using RopeFn = void (*)(const T*, const T*, const T*, T*, const int64_t*, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t);

template <typename T>
struct Fns {
  SwigluFn<T> swiglu;
  RopeFn<T> rope_fwd, rope_bwd;
};

struct IsaPath {  // one ISA's loops
  const char* name;
  Fns<float> f32;
  Fns<c10::BFloat16> bf16;
  Fns<c10::Half> f16;
};

#define HR_ACT_FNS(ns, T) \
  Fns<T>{&ns::swiglu_rows<T>, &ns::rope_tokens<T, false>, &ns::rope_tokens<T, true>}
#define HR_ACT_PATH(name, ns) \
  IsaPath{name, HR_ACT_FNS(ns, float), HR_ACT_FNS(ns, c10::BFloat16), HR_ACT_FNS(ns, c10::Half)}

// The paths this CPU can run, best first; the baseline is always last (kl_cpu.cpp's rule).
std::vector<IsaPath> available_paths() {
  std::vector<IsaPath> paths;
#ifdef HR_ACT_X86
  const isa_select::SimdLevels cpu = isa_select::cpu_simd_levels();
  if (cpu.avx512) paths.push_back(HR_ACT_PATH("avx512", act_avx512));
  if (cpu.avx2) paths.push_back(HR_ACT_PATH("avx2", act_avx2));
#endif
  paths.push_back(HR_ACT_PATH("baseline", act_base));
  return paths;
}

// HYBRIDRL_CPU_ISA (read once, at the first call): unset/"auto" takes the best path, a path's
// name forces it; a name this CPU cannot run raises ValueError naming the ones it can.
IsaPath choose_path() {
  return isa_select::pick_isa_path(available_paths(), isa_select::isa_env(), "HYBRIDRL_CPU_ISA=",
                                   "a SwiGLU/RoPE");
}

const IsaPath& isa_path() {
  static const IsaPath path = choose_path();
  return path;
}

template <typename T>
const Fns<T>& fns(const IsaPath& p) {
  if constexpr (std::is_same_v<T, float>) return p.f32;
  if constexpr (std::is_same_v<T, c10::BFloat16>) return p.bf16;
  if constexpr (std::is_same_v<T, c10::Half>) return p.f16;
}

constexpr int64_t kGrain = 1 << 15;  // elements per parallel task
constexpr int64_t kLowpMaxD = 512;   // act_*::kBlock: the widest bf16/fp16 RoPE row

void check_dtype(const char* op, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                    t.scalar_type() == at::kHalf, op, ": dtype must be float32, bfloat16 or "
                    "float16 (float64 runs eager torch in hybridrl.kernels), got ", t.scalar_type());
}

// grad undefined: forward [..., f]; else backward [..., 2f].
at::Tensor swiglu_apply(const at::Tensor& grad_in, const at::Tensor& x_in) {
  const bool bwd = grad_in.defined();
  const char* op = bwd ? "swiglu_bwd" : "swiglu_fwd";
  check_dtype(op, x_in);
  TORCH_CHECK_VALUE(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0, op, ": the last dim of x must "
                    "be even (gate | up halves), got shape ", x_in.sizes());
  const int64_t f = x_in.size(-1) / 2;
  std::vector<int64_t> half_shape = x_in.sizes().vec();
  half_shape.back() = f;
  if (bwd) {
    TORCH_CHECK_VALUE(grad_in.sizes() == at::IntArrayRef(half_shape), op, ": grad must have "
                      "shape ", at::IntArrayRef(half_shape), ", got ", grad_in.sizes());
  }
  const at::Tensor x = x_in.contiguous();
  const at::Tensor grad = bwd ? grad_in.to(x.scalar_type()).contiguous() : grad_in;
  at::Tensor out = at::empty(bwd ? x.sizes() : at::IntArrayRef(half_shape), x.options());
  const int64_t rows = f == 0 ? 0 : x.numel() / (2 * f);
  const IsaPath& path = isa_path();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "swiglu_cpu", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const auto fn = fns<scalar_t>(path).swiglu;
      const scalar_t* g = bwd ? grad.const_data_ptr<scalar_t>() : nullptr;
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      scalar_t* o = out.mutable_data_ptr<scalar_t>();
      const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, 2 * f));
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { fn(g, xp, o, f, r0, r1); });
    }
  });
  return out;
}

at::Tensor swiglu_fwd_cpu(const at::Tensor& x) { return swiglu_apply(at::Tensor(), x); }

at::Tensor swiglu_bwd_cpu(const at::Tensor& grad, const at::Tensor& x) {
  TORCH_CHECK_VALUE(grad.defined(), "swiglu_bwd: grad is undefined");
  return swiglu_apply(grad, x);
}

at::Tensor rope_apply(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                      bool bwd) {
  const char* op = bwd ? "rope_bwd" : "rope_fwd";
  check_dtype(op, x_in);
  const int64_t nd = x_in.dim();
  TORCH_CHECK_VALUE(nd >= 2, op, ": x must be [t, ..., d], got shape ", x_in.sizes());
  const int64_t d = x_in.size(-1), t = x_in.size(0);
  TORCH_CHECK_VALUE(d % 2 == 0, op, ": the head dim d must be even (rotate_half halves), got ", d);
  TORCH_CHECK_VALUE(cos_in.sizes() == sin_in.sizes(), op, ": cos ", cos_in.sizes(),
                    " and sin ", sin_in.sizes(), " must have one shape");
  TORCH_CHECK_VALUE(cos_in.scalar_type() == x_in.scalar_type() &&
                    sin_in.scalar_type() == x_in.scalar_type(), op, ": cos and sin must have "
                    "x's dtype ", x_in.scalar_type());
  bool ok = cos_in.dim() == nd && cos_in.size(-1) == d && (cos_in.size(0) == t || cos_in.size(0) == 1);
  for (int64_t i = 1; ok && i + 1 < nd; ++i) ok = cos_in.size(i) == 1;
  TORCH_CHECK_VALUE(ok, op, ": cos/sin must be [t or 1, 1, ..., 1, d] for x of shape ",
                    x_in.sizes(), ", got ", cos_in.sizes());
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat || d <= kLowpMaxD, op, ": bf16/fp16 head "
                    "dim must be <= ", kLowpMaxD, ", got ", d);
  const at::Tensor x = x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor cs = cos_in.contiguous(), sn = sin_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  // start offsets of the middle-dim rows of one token, row-major (x may be strided there)
  std::vector<int64_t> mid{0};
  for (int64_t i = 1; i + 1 < nd; ++i) {
    std::vector<int64_t> next;
    next.reserve(mid.size() * x.size(i));
    for (int64_t base : mid) {
      for (int64_t j = 0; j < x.size(i); ++j) next.push_back(base + j * x.stride(i));
    }
    mid.swap(next);
  }
  const int64_t nmid = static_cast<int64_t>(mid.size());
  const int64_t cs0 = cs.size(0) == 1 ? 0 : d;
  const IsaPath& path = isa_path();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_cpu", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const auto fn = bwd ? fns<scalar_t>(path).rope_bwd : fns<scalar_t>(path).rope_fwd;
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      const scalar_t* cp = cs.const_data_ptr<scalar_t>();
      const scalar_t* sp = sn.const_data_ptr<scalar_t>();
      scalar_t* o = out.mutable_data_ptr<scalar_t>();
      const int64_t grain = std::max<int64_t>(1, kGrain / (nmid * d));
      at::parallel_for(0, t, grain, [&](int64_t t0, int64_t t1) {
        fn(xp, cp, sp, o, mid.data(), nmid, x.stride(0), cs0, d, t0, t1);
      });
    }
  });
  return out;
}

at::Tensor rope_fwd_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_apply(x, cos, sin, false);
}

at::Tensor rope_bwd_cpu(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_apply(grad, cos, sin, true);
}

std::string swiglu_cpu_isa() { return isa_path().name; }

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_FRAGMENT(hybridrl, m) {
  m.def("swiglu_fwd(Tensor x) -> Tensor");
  m.def("swiglu_bwd(Tensor grad, Tensor x) -> Tensor");
  m.def("rope_fwd(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rope_bwd(Tensor grad, Tensor cos, Tensor sin) -> Tensor");
  m.def("swiglu_cpu_isa() -> str", &hybridrl::swiglu_cpu_isa);
}

TORCH_LIBRARY_IMPL(hybridrl, CPU, m) {
  m.impl("swiglu_fwd", &hybridrl::swiglu_fwd_cpu);
  m.impl("swiglu_bwd", &hybridrl::swiglu_bwd_cpu);
  m.impl("rope_fwd", &hybridrl::rope_fwd_cpu);
  m.impl("rope_bwd", &hybridrl::rope_bwd_cpu);
}
