// Shared scalar math of the hybridrl kernels (host and device), the C++ twin of
// hybridrl/kernels/reference.py. Every formula mirrors the reference op for op (same order of
// rounding) so fp32 results match it to the last bits where the libm does; `acc_t` is float for
// fp32/bf16/fp16 inputs (fp32 accumulation) and double for fp64.
#pragma once

#include <cstdint>
#include <cmath>

#if defined(__CUDACC__)
#define HR_HD __host__ __device__ __forceinline__
#else
#define HR_HD inline
#endif

namespace hybridrl {

// Estimator codes, identical to KL_K1.. in hybridrl/kernels/reference.py.
enum KlKind : int64_t { kK1 = 0, kAbs = 1, kK2 = 2, kK3 = 3 };
// Forward-only flag of the straight-through ("+") kinds: kernel code = base code | kStraight.
constexpr int64_t kStraight = 4;

// Kernel code of the forward value for the op arguments (fwd_kind, bwd_kind): fwd_kind itself,
// or fwd_kind | kStraight when they differ (the "+" kinds; callers check bwd_kind == kK2).
inline int64_t kl_forward_code(int64_t fwd_kind, int64_t bwd_kind) {
  return fwd_kind == bwd_kind ? fwd_kind : (fwd_kind | kStraight);
}

constexpr float kKlClamp = 20.0f;   // clamp of (ref - logp) inside k3
constexpr float kKldClamp = 10.0f;  // clamp of the k3 value

// torch.clamp semantics: NaN propagates, bounds inclusive.
template <typename acc_t>
HR_HD acc_t clamp_val(acc_t x, acc_t lo, acc_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// p = e^x / 2^n for |x| <= 20 and n = round(x / ln 2): a branch-free Cody-Waite reduction
// r = x - n ln 2 (|r| <= 0.35) and the degree-7 Taylor polynomial of e^r. F is float or a float
// SIMD vector (csrc/cpu/kl_spans.h; by reference, so no vector crosses a call ABI), so the
// scalar and vector exps are one formula.
template <typename F>
HR_HD void exp_reduced(const F& x, F& n, F& p) {
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  n = (x * 1.44269504f + shifter) - shifter;
  const F r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  p = F{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
}

// exp for |x| <= 20 (k3's clamped argument). CUDA: the accurate libdevice expf (not __expf).
// CPU, float: exp_reduced(x) * 2^n, 2^n built in the exponent bits (<= 2 ulp of exp; std::exp
// does not vectorize without -ffast-math).
HR_HD float exp_clamped(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  float n, p;
  exp_reduced(x, n, p);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, |n| <= 29
  return p * __builtin_bit_cast(float, bits);
#endif
}

HR_HD double exp_clamped(double x) { return exp(x); }

// Forward value of estimator KIND on one token. KIND | kStraight is verl's straight-through
// `b - b.detach() + f.detach()` with b = k2: (b - b) + f, i.e. f where 0.5 d^2 is finite in
// acc_t and NaN where it overflows or d is not finite (no fast-math: b - b is not folded).
template <int64_t KIND, typename acc_t>
HR_HD acc_t kl_value(acc_t logp, acc_t ref) {
  if constexpr ((KIND & kStraight) != 0) {
    const acc_t b = kl_value<kK2, acc_t>(logp, ref);
    return (b - b) + kl_value<(KIND & ~kStraight), acc_t>(logp, ref);
  } else if constexpr (KIND == kK1) {
    return logp - ref;
  } else if constexpr (KIND == kAbs) {
    const acc_t d = logp - ref;
    return d < acc_t(0) ? -d : d;
  } else if constexpr (KIND == kK2) {
    const acc_t d = logp - ref;
    return acc_t(0.5) * (d * d);
  } else {
    const acc_t kl = clamp_val<acc_t>(ref - logp, -kKlClamp, kKlClamp);
    const acc_t kld = (exp_clamped(kl) - kl) - acc_t(1);
    return clamp_val<acc_t>(kld, -kKldClamp, kKldClamp);
  }
}

// d(out)/d(logprob) * grad for estimator KIND; d/d(ref_logprob) is its negation.
// Mirrors torch autograd of the reference: clamp passes the gradient where lo <= x <= hi.
template <int64_t KIND, typename acc_t>
HR_HD acc_t kl_grad(acc_t grad, acc_t logp, acc_t ref) {
  if constexpr (KIND == kK1) {
    return grad;
  } else if constexpr (KIND == kAbs) {
    const acc_t d = logp - ref;
    const acc_t sgn = d > acc_t(0) ? acc_t(1) : (d < acc_t(0) ? acc_t(-1) : acc_t(0));
    return grad * sgn;
  } else if constexpr (KIND == kK2) {
    return (acc_t(0.5) * grad) * (acc_t(2) * (logp - ref));
  } else {
    const acc_t diff = ref - logp;
    const acc_t kl = clamp_val<acc_t>(diff, -kKlClamp, kKlClamp);
    const acc_t e = exp_clamped(kl);
    const acc_t kld = (e - kl) - acc_t(1);
    // Selects written as plain ternaries over computed values so they vectorize as blends.
    const acc_t g_kld = kld >= acc_t(-kKldClamp) ? (kld <= acc_t(kKldClamp) ? grad : acc_t(0))
                                                   : acc_t(0);
    const acc_t g_c = g_kld * e - g_kld;  // exp'(kl) = e, and the -kl term
    const acc_t g_kl = diff >= acc_t(-kKlClamp) ? (diff <= acc_t(kKlClamp) ? g_c : acc_t(0))
                                                 : acc_t(0);
    return -g_kl;  // kl = ref - logp
  }
}

// One reverse GAE step (verl's loop body); updates nextv and last in place, returns adv_t.
template <typename acc_t>
HR_HD acc_t gae_step(acc_t r, acc_t v, acc_t m, acc_t gamma, acc_t gamma_lam, acc_t& nextv,
                     acc_t& last) {
  const acc_t delta = (r + gamma * nextv) - v;
  const acc_t g = delta + gamma_lam * last;
  const acc_t keep = acc_t(1) - m;
  nextv = v * m + keep * nextv;
  last = g * m + keep * last;
  return last;
}

}  // namespace hybridrl
