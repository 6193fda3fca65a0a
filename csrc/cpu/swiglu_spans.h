// Contiguous loops of the fused SwiGLU and RoPE kernels (fp32 math), written on explicit SIMD
// vectors (the GCC/Clang vector extension). Included once per CPU ISA by swiglu_cpu.cpp inside a
// namespace of internal linkage that defines `kVecBytes` (64 AVX-512, 32 AVX2, 16 baseline),
// `kHalfLanes`, `widen_half` and `narrow_half`, under a matching `#pragma GCC target`; no include
// guard on purpose. Every formula is written op for op as torch's eager CPU kernels compute it
// (no FMA: the build uses -ffp-contract=off), so every ISA path gives the same bits.

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

// e^x for every float x (NaN stays NaN): x clamped to [-104, 89] (e^-104 rounds to 0 and e^89 to
// inf, as expf does), common.h's exp_reduced (|n| <= 150), then 2^n as 2^(n>>1) * 2^(n-(n>>1)),
// two normal powers, so results that overflow or are subnormal round once like expf's.
inline vfloat vexp(vfloat x) {
  x = x < -104.0f ? splat(-104.0f) : x;  // a NaN compares false and is kept
  x = x > 89.0f ? splat(89.0f) : x;
  vfloat n, p;
  ::hybridrl::exp_reduced(x, n, p);
  const vint ni = __builtin_convertvector(n, vint);
  const vint n1 = ni >> 1, n2 = ni - n1;
  return (p * (vfloat)((n1 + 127) << 23)) * (vfloat)((n2 + 127) << 23);  // bit casts
}

// ---- SwiGLU: out = silu(gate) * up, silu(g) = g / (1 + e^-g) (torch's CPU silu) ----

inline vfloat vswiglu(vfloat g, vfloat u) { return (g / (1.0f + vexp(-g))) * u; }

// torch's autograd of silu(gate) * up: d up = dy * silu(gate); d gate = silu_backward(dy * up),
// silu_backward(t, g) = t * sig * (1 + g * (1 - sig)), sig = 1 / (1 + e^-g).
inline void vswiglu_bwd(vfloat dy, vfloat g, vfloat u, vfloat& dg, vfloat& du) {
  const vfloat den = 1.0f + vexp(-g);
  const vfloat sig = 1.0f / den;
  du = dy * (g / den);
  dg = ((dy * u) * sig) * (1.0f + g * (1.0f - sig));
}

// n elements of one row. Forward (dy null): out_g[i] = silu(gate[i]) * up[i]. Backward: out_g =
// d gate, out_u = d up. Tails run the same vector code on a zero-padded copy.
void swiglu_span(const float* dy, const float* gate, const float* up, float* out_g, float* out_u,
                 int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat g = vload(gate + i), u = vload(up + i);
    if (dy) {
      vfloat dg, du;
      vswiglu_bwd(vload(dy + i), g, u, dg, du);
      vstore(out_g + i, dg);
      vstore(out_u + i, du);
    } else {
      vstore(out_g + i, vswiglu(g, u));
    }
  }
  if (i == n) return;
  float d_pad[kLanes] = {}, g_pad[kLanes] = {}, u_pad[kLanes] = {}, og[kLanes], ou[kLanes];
  const int64_t rest = n - i;
  __builtin_memcpy(g_pad, gate + i, rest * sizeof(float));
  __builtin_memcpy(u_pad, up + i, rest * sizeof(float));
  if (dy) __builtin_memcpy(d_pad, dy + i, rest * sizeof(float));
  swiglu_span(dy ? d_pad : nullptr, g_pad, u_pad, og, ou, kLanes);
  __builtin_memcpy(out_g + i, og, rest * sizeof(float));
  if (dy) __builtin_memcpy(out_u + i, ou, rest * sizeof(float));
}

// ---- RoPE, megatron's non-interleaved rotate_half layout, halves of h = d / 2 ----
// forward  (x * cos + cat(-x2, x1) * sin):  o1 = x1 c1 - x2 s1,  o2 = x2 c2 + x1 s2
// backward (its transpose, on the gradient): o1 = x1 c1 + x2 s2,  o2 = x2 c2 - x1 s1
template <bool BWD>
void rope_row(const float* x, const float* c, const float* s, float* o, int64_t h) {
  int64_t i = 0;
  for (; i + kLanes <= h; i += kLanes) {
    const vfloat x1 = vload(x + i), x2 = vload(x + h + i);
    const vfloat s1 = vload(s + i), s2 = vload(s + h + i);
    if constexpr (BWD) {
      vstore(o + i, x1 * vload(c + i) + x2 * s2);
      vstore(o + h + i, x2 * vload(c + h + i) - x1 * s1);
    } else {
      vstore(o + i, x1 * vload(c + i) - x2 * s1);
      vstore(o + h + i, x2 * vload(c + h + i) + x1 * s2);
    }
  }
  if (i == h) return;
  float xp[2 * kLanes] = {}, cp[2 * kLanes] = {}, sp[2 * kLanes] = {}, op[2 * kLanes];
  const int64_t rest = h - i;
  for (int half = 0; half < 2; ++half) {
    __builtin_memcpy(xp + half * kLanes, x + half * h + i, rest * sizeof(float));
    __builtin_memcpy(cp + half * kLanes, c + half * h + i, rest * sizeof(float));
    __builtin_memcpy(sp + half * kLanes, s + half * h + i, rest * sizeof(float));
  }
  rope_row<BWD>(xp, cp, sp, op, kLanes);
  __builtin_memcpy(o + i, op, rest * sizeof(float));
  __builtin_memcpy(o + h + i, op + kLanes, rest * sizeof(float));
}

// ---- bf16 / fp16: widened into fp32 stack buffers, rounded back once ----

inline void widen(const float* src, float* dst, int64_t n) {
  __builtin_memcpy(dst, src, n * sizeof(float));
}

#include "lowp_convert.h"  // widen / narrow for bf16 and fp16 (this path's copy)

constexpr int64_t kBlock = 512;  // fp32 elements per stack buffer (2 KiB)

// SwiGLU over rows [r0, r1) of [rows, 2f] (dy: [rows, f], null in the forward); out is [rows, f]
// (forward) or [rows, 2f] (backward).
template <typename T>
void swiglu_rows(const T* dy, const T* x, T* out, int64_t f, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = x + r * 2 * f;
    const T* d = dy ? dy + r * f : nullptr;
    T* og = out + r * (dy ? 2 * f : f);
    if constexpr (std::is_same_v<T, float>) {
      swiglu_span(d, gate, gate + f, og, og + f, f);
    } else {
      float db[kBlock], gb[kBlock], ub[kBlock], ogb[kBlock], oub[kBlock];
      for (int64_t b = 0; b < f; b += kBlock) {
        const int64_t m = f - b < kBlock ? f - b : kBlock;
        widen(gate + b, gb, m);
        widen(gate + f + b, ub, m);
        if (d) widen(d + b, db, m);
        swiglu_span(d ? db : nullptr, gb, ub, ogb, oub, m);
        narrow(ogb, og + b, m);
        if (d) narrow(oub, og + f + b, m);
      }
    }
  }
}

// RoPE over tokens [t0, t1): row (t, r) of x starts at t * xs0 + mid[r] (strided heads), of out
// at (t * nmid + r) * d (contiguous); cos/sin rows at t * cs0 (0: one row broadcast).
template <typename T, bool BWD>
void rope_tokens(const T* x, const T* cs, const T* sn, T* out, const int64_t* mid, int64_t nmid,
                 int64_t xs0, int64_t cs0, int64_t d, int64_t t0, int64_t t1) {
  const int64_t h = d / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const T* c = cs + t * cs0;
    const T* s = sn + t * cs0;
    T* o = out + t * nmid * d;
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t r = 0; r < nmid; ++r) rope_row<BWD>(x + t * xs0 + mid[r], c, s, o + r * d, h);
    } else {  // d <= kBlock (checked by the caller)
      float cb[kBlock], sb[kBlock], xb[kBlock], ob[kBlock];
      widen(c, cb, d);
      widen(s, sb, d);
      for (int64_t r = 0; r < nmid; ++r) {
        widen(x + t * xs0 + mid[r], xb, d);
        rope_row<BWD>(xb, cb, sb, ob, h);
        narrow(ob, o + r * d, d);
      }
    }
  }
}
