// Contiguous loops of the KL kernels (fp32, bf16, fp16), written on explicit SIMD vectors (the
// GCC/Clang vector extension) so they vectorize whatever the compiler's if-conversion does.
// Included once per CPU ISA (see kl_cpu.cpp) inside a namespace that defines `kVecBytes` (64
// AVX-512, 32 AVX2, 16 baseline: SSE2 on x86-64, NEON on aarch64), `max_ps`, `min_ps`,
// `kHalfLanes`, `widen_half` and `narrow_half`, under a matching `#pragma GCC target`; no include
// guard on purpose.
//
// Every formula is common.h's scalar kl_value / kl_grad / exp_clamped, op for op in the same
// order (no FMA: the extension is built with -ffp-contract=off), so all ISA paths give the same
// bits. Selects are vector ternaries (blends): torch.clamp's NaN propagation and inclusive
// bounds carry over unchanged. Tails (n not a multiple of the lane count) run the same vector
// code on a zero-padded copy.

constexpr int64_t kLanes = kVecBytes / 4;
typedef float vfloat __attribute__((vector_size(kVecBytes)));
typedef int32_t vint __attribute__((vector_size(kVecBytes)));

inline vfloat vload(const float* p) {
  vfloat v;
  __builtin_memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

inline void vstore(float* p, vfloat v) { __builtin_memcpy(p, &v, sizeof v); }

inline vfloat splat(float s) { return vfloat{} + s; }

// torch.clamp: NaN passes through, bounds inclusive. The including namespace's max_ps(a, b) and
// min_ps(a, b) are `a > b ? a : b` and `a < b ? a : b` (x86 maxps / minps, one instruction each),
// so x, the second operand, comes back when it is NaN.
inline vfloat vclamp(vfloat x, float lo, float hi) {
  return min_ps(splat(hi), max_ps(splat(lo), x));
}

// common.h exp_clamped on kLanes lanes (the same exp_reduced, then 2^n in the exponent bits).
inline vfloat vexp_clamped(vfloat x) {
  vfloat n, p;
  ::hybridrl::exp_reduced(x, n, p);
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;  // 2^n, |n| <= 29
  return p * (vfloat)bits;  // same-size vector cast: a bit cast
}

// kl_value<KIND, float> on kLanes tokens.
template <int64_t KIND>
inline vfloat vvalue(vfloat lp, vfloat ref) {
  if constexpr ((KIND & ::hybridrl::kStraight) != 0) {
    const vfloat b = vvalue<::hybridrl::kK2>(lp, ref);
    return (b - b) + vvalue<(KIND & ~::hybridrl::kStraight)>(lp, ref);
  } else if constexpr (KIND == ::hybridrl::kK1) {
    return lp - ref;
  } else if constexpr (KIND == ::hybridrl::kAbs) {
    const vfloat d = lp - ref;
    return d < 0.0f ? -d : d;
  } else if constexpr (KIND == ::hybridrl::kK2) {
    const vfloat d = lp - ref;
    return 0.5f * (d * d);
  } else {
    const vfloat kl = vclamp(ref - lp, -::hybridrl::kKlClamp, ::hybridrl::kKlClamp);
    const vfloat kld = (vexp_clamped(kl) - kl) - 1.0f;
    return vclamp(kld, -::hybridrl::kKldClamp, ::hybridrl::kKldClamp);
  }
}

// kl_grad<KIND, float> on kLanes tokens: d(out)/d(logprob) * grad.
template <int64_t KIND>
inline vfloat vgrad(vfloat grad, vfloat lp, vfloat ref) {
  const vfloat zero = splat(0.0f);
  if constexpr (KIND == ::hybridrl::kK1) {
    return grad;
  } else if constexpr (KIND == ::hybridrl::kAbs) {
    const vfloat d = lp - ref;
    const vfloat sgn = d > 0.0f ? splat(1.0f) : (d < 0.0f ? splat(-1.0f) : zero);
    return grad * sgn;
  } else if constexpr (KIND == ::hybridrl::kK2) {
    return (0.5f * grad) * (2.0f * (lp - ref));
  } else {
    const vfloat diff = ref - lp;
    const vfloat kl = vclamp(diff, -::hybridrl::kKlClamp, ::hybridrl::kKlClamp);
    const vfloat e = vexp_clamped(kl);
    const vfloat kld = (e - kl) - 1.0f;
    const vfloat g_kld =
        kld >= -::hybridrl::kKldClamp ? (kld <= ::hybridrl::kKldClamp ? grad : zero) : zero;
    const vfloat g_c = g_kld * e - g_kld;
    const vfloat g_kl =
        diff >= -::hybridrl::kKlClamp ? (diff <= ::hybridrl::kKlClamp ? g_c : zero) : zero;
    return -g_kl;  // kl = ref - logp
  }
}

// out[i] = value or grad of KIND over [0, n); grad is read only when BWD.
template <int64_t KIND, bool BWD>
void kl_span_kind(const float* grad, const float* lp, const float* ref, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat p = vload(lp + i), r = vload(ref + i);
    if constexpr (BWD) {
      vstore(out + i, vgrad<KIND>(vload(grad + i), p, r));
    } else {
      vstore(out + i, vvalue<KIND>(p, r));
    }
  }
  if (i == n) return;
  float g_pad[kLanes] = {}, p_pad[kLanes] = {}, r_pad[kLanes] = {}, o_pad[kLanes];
  const int64_t rest = n - i;
  __builtin_memcpy(p_pad, lp + i, rest * sizeof(float));
  __builtin_memcpy(r_pad, ref + i, rest * sizeof(float));
  if constexpr (BWD) __builtin_memcpy(g_pad, grad + i, rest * sizeof(float));
  kl_span_kind<KIND, BWD>(g_pad, p_pad, r_pad, o_pad, kLanes);
  __builtin_memcpy(out + i, o_pad, rest * sizeof(float));
}

// grad == nullptr: forward of kernel code `kind`; else backward. One switch per span.
void kl_span(int64_t kind, const float* grad, const float* lp, const float* ref, float* out,
             int64_t n) {
  using namespace ::hybridrl;
  const bool bwd = grad != nullptr;
  switch (kind) {
    case kK1:
      return bwd ? kl_span_kind<kK1, true>(grad, lp, ref, out, n)
                 : kl_span_kind<kK1, false>(grad, lp, ref, out, n);
    case kAbs:
      return bwd ? kl_span_kind<kAbs, true>(grad, lp, ref, out, n)
                 : kl_span_kind<kAbs, false>(grad, lp, ref, out, n);
    case kK2:
      return bwd ? kl_span_kind<kK2, true>(grad, lp, ref, out, n)
                 : kl_span_kind<kK2, false>(grad, lp, ref, out, n);
    case kK1 | kStraight:  // the "+" codes: forward only
      return kl_span_kind<kK1 | kStraight, false>(grad, lp, ref, out, n);
    case kAbs | kStraight:
      return kl_span_kind<kAbs | kStraight, false>(grad, lp, ref, out, n);
    case kK3 | kStraight:
      return kl_span_kind<kK3 | kStraight, false>(grad, lp, ref, out, n);
    default:
      return bwd ? kl_span_kind<kK3, true>(grad, lp, ref, out, n)
                 : kl_span_kind<kK3, false>(grad, lp, ref, out, n);
  }
}

// bf16 / fp16: blocks of kBlock elements widened into fp32 stack buffers (16 KiB, L1-resident),
// run by kl_span, rounded back once. bf16 is plain integer code (auto-vectorized); fp16 uses
// the including namespace's widen_half / narrow_half on kHalfLanes elements (F16C or AVX-512
// where the path has them, else c10's scalar conversion).
constexpr int64_t kBlock = 1024;

#include "lowp_convert.h"  // widen / narrow for bf16 and fp16 (this path's copy)

template <typename scalar_t>
void kl_span_lowp(int64_t kind, const scalar_t* grad, const scalar_t* lp, const scalar_t* ref,
                  scalar_t* out, int64_t n) {
  float g_buf[kBlock], lp_buf[kBlock], ref_buf[kBlock], out_buf[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = n - b < kBlock ? n - b : kBlock;
    widen(lp + b, lp_buf, m);
    widen(ref + b, ref_buf, m);
    if (grad) widen(grad + b, g_buf, m);
    kl_span(kind, grad ? g_buf : nullptr, lp_buf, ref_buf, out_buf, m);
    narrow(out_buf, out + b, m);
  }
}

void kl_span_bf16(int64_t kind, const c10::BFloat16* grad, const c10::BFloat16* lp,
                  const c10::BFloat16* ref, c10::BFloat16* out, int64_t n) {
  kl_span_lowp(kind, grad, lp, ref, out, n);
}

void kl_span_half(int64_t kind, const c10::Half* grad, const c10::Half* lp, const c10::Half* ref,
                  c10::Half* out, int64_t n) {
  kl_span_lowp(kind, grad, lp, ref, out, n);
}
