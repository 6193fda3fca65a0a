// AVX2 GAE loop for fp32, 8 rows at a time held in registers, compiled for AVX2 by the
// `#pragma GCC target` below (callers check __builtin_cpu_supports("avx2") first). Steps are
// consumed in blocks of 16 from the end of the rows: each 8-step half block of each input is an
// 8 x 8 register transpose (rows -> steps), the recurrence runs on 8-row vectors with separate
// mul/add (never fused: bit-identical to the reference loop), and outputs are transposed back.
// The first T % 16 steps finish per row in scalar code.
#pragma once

#include <immintrin.h>

#include "../common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace hybridrl {
namespace avx2 {

constexpr int64_t kPrefetch = 64;  // steps ahead (backwards) to prefetch

// In-place 8 x 8 transpose: x[k] (row k, 8 consecutive steps) -> x[j] (step j, 8 rows).
inline void transpose8(__m256 x[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(x[0], x[1]), t1 = _mm256_unpackhi_ps(x[0], x[1]);
  const __m256 t2 = _mm256_unpacklo_ps(x[2], x[3]), t3 = _mm256_unpackhi_ps(x[2], x[3]);
  const __m256 t4 = _mm256_unpacklo_ps(x[4], x[5]), t5 = _mm256_unpackhi_ps(x[4], x[5]);
  const __m256 t6 = _mm256_unpacklo_ps(x[6], x[7]), t7 = _mm256_unpackhi_ps(x[6], x[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  x[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  x[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  x[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  x[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  x[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  x[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  x[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  x[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

constexpr int64_t kSkew = 16;       // steps (one cache line of fp32) between neighbouring lanes
constexpr int64_t kSkewMinT = 1024;  // shorter rows are not skewed (aliasing needs T >= 1024)

// Scalar steps [t_lo, t_hi) of the row at offset `row`, walked backwards (common.h gae_step).
inline void scalar_steps(const float* rew, const float* val, const float* msk, float* adv,
                         float* ret, int64_t row, int64_t t_lo, int64_t t_hi, float gamma,
                         float gl, float& nv, float& la) {
  for (int64_t t = t_hi - 1; t >= t_lo; --t) {
    const int64_t i = row + t;
    const float a = gae_step<float>(rew[i], val[i], msk[i], gamma, gl, nv, la);
    adv[i] = a;
    ret[i] = a + val[i];
  }
}

inline void load_block(const float* src, int64_t T, int64_t t0, __m256 x[8]) {
  for (int k = 0; k < 8; ++k) {
    // Walking backwards through 8 rows x 3 inputs outruns the hardware prefetchers.
    if (t0 >= kPrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(src + k * T + t0 - kPrefetch), _MM_HINT_T0);
    }
    x[k] = _mm256_loadu_ps(src + k * T + t0);
  }
  transpose8(x);
}

inline void store_block(float* dst, int64_t T, int64_t t0, __m256 x[8]) {
  transpose8(x);
  for (int k = 0; k < 8; ++k) _mm256_storeu_ps(dst + k * T + t0, x[k]);
}

// Steps [0, len) of 8 rows (lane k reads row k at k * ld), walked backwards from the lanes'
// state (nv, la), which is updated. Blocks of 16 steps, so every cache line of the inputs is
// consumed whole at once; the first len % 16 steps finish per row in scalar code.
inline void gae_span8(const float* rew, const float* val, const float* msk, float* adv,
                      float* ret, int64_t ld, int64_t len, float gamma, float gl, float nv[8],
                      float la[8]) {
  constexpr int64_t kBlock = 16;
  const __m256 vg = _mm256_set1_ps(gamma), vgl = _mm256_set1_ps(gl), one = _mm256_set1_ps(1.f);
  __m256 nextv = _mm256_loadu_ps(nv), last = _mm256_loadu_ps(la);
  int64_t t1 = len;
  for (; t1 >= kBlock; t1 -= kBlock) {
    const int64_t t0 = t1 - kBlock;
    __m256 r[kBlock], v[kBlock], m[kBlock];
    for (int64_t h = 0; h < kBlock; h += 8) {
      load_block(rew, ld, t0 + h, r + h);
      load_block(val, ld, t0 + h, v + h);
      load_block(msk, ld, t0 + h, m + h);
    }
    for (int64_t j = kBlock - 1; j >= 0; --j) {  // common.h gae_step, op for op
      const __m256 delta = _mm256_sub_ps(_mm256_add_ps(r[j], _mm256_mul_ps(vg, nextv)), v[j]);
      const __m256 g = _mm256_add_ps(delta, _mm256_mul_ps(vgl, last));
      const __m256 keep = _mm256_sub_ps(one, m[j]);
      nextv = _mm256_add_ps(_mm256_mul_ps(v[j], m[j]), _mm256_mul_ps(keep, nextv));
      last = _mm256_add_ps(_mm256_mul_ps(g, m[j]), _mm256_mul_ps(keep, last));
      r[j] = last;                       // advantages
      v[j] = _mm256_add_ps(last, v[j]);  // returns
    }
    for (int64_t h = 0; h < kBlock; h += 8) {
      store_block(adv, ld, t0 + h, r + h);
      store_block(ret, ld, t0 + h, v + h);
    }
  }
  _mm256_storeu_ps(nv, nextv);
  _mm256_storeu_ps(la, last);
  for (int k = 0; k < 8; ++k) scalar_steps(rew, val, msk, adv, ret, k * ld, 0, t1, gamma, gl,
                                           nv[k], la[k]);
}

// Rows [0, 8) from the given pointers (row stride T). Lane k runs kSkew * k steps behind lane 0
// (the vector loop reads row k at stride T - kSkew): rows T * 4 bytes apart with T a multiple of
// 1024 would otherwise put the 8 rows' cache lines in one L1 set (2-2.5x slower). Each row's
// latest kSkew * k and earliest kSkew * (7 - k) steps run in scalar code.
inline void gae_rows8(const float* rew, const float* val, const float* msk, float* adv,
                      float* ret, int64_t T, float gamma, float gl) {
  alignas(32) float nv[8] = {}, la[8] = {};
  if (T < kSkewMinT) {
    gae_span8(rew, val, msk, adv, ret, T, T, gamma, gl, nv, la);
    return;
  }
  const int64_t lag = kSkew * 7;
  for (int k = 0; k < 8; ++k) {  // lane k first walks its latest kSkew * k steps alone
    scalar_steps(rew, val, msk, adv, ret, k * T, T - kSkew * k, T, gamma, gl, nv[k], la[k]);
  }
  // Virtual step j in [0, T - lag) is step lag - kSkew * k + j of row k.
  gae_span8(rew + lag, val + lag, msk + lag, adv + lag, ret + lag, T - kSkew, T - lag, gamma, gl,
            nv, la);
  for (int k = 0; k < 8; ++k) {  // ... and last its earliest lag - kSkew * k steps
    scalar_steps(rew, val, msk, adv, ret, k * T, 0, lag - kSkew * k, gamma, gl, nv[k], la[k]);
  }
}

}  // namespace avx2
}  // namespace hybridrl

#pragma GCC pop_options
