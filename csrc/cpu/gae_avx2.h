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

// Rows [0, 8) from the given pointers (row stride T). Blocks of kBlock = 16 steps: every cache
// line of the inputs is consumed whole at once (a row stride of 4 KiB maps all 8 rows to one L1
// set, so a line revisited later would be gone).
inline void gae_rows8(const float* rew, const float* val, const float* msk, float* adv,
                      float* ret, int64_t T, float gamma, float gl) {
  constexpr int64_t kBlock = 16;
  const __m256 vg = _mm256_set1_ps(gamma), vgl = _mm256_set1_ps(gl), one = _mm256_set1_ps(1.f);
  __m256 nextv = _mm256_setzero_ps(), last = _mm256_setzero_ps();
  int64_t t1 = T;
  for (; t1 >= kBlock; t1 -= kBlock) {
    const int64_t t0 = t1 - kBlock;
    __m256 r[kBlock], v[kBlock], m[kBlock];
    for (int64_t h = 0; h < kBlock; h += 8) {
      load_block(rew, T, t0 + h, r + h);
      load_block(val, T, t0 + h, v + h);
      load_block(msk, T, t0 + h, m + h);
    }
    for (int64_t j = kBlock - 1; j >= 0; --j) {  // common.h gae_step, op for op
      const __m256 delta = _mm256_sub_ps(_mm256_add_ps(r[j], _mm256_mul_ps(vg, nextv)), v[j]);
      const __m256 g = _mm256_add_ps(delta, _mm256_mul_ps(vgl, last));
      const __m256 keep = _mm256_sub_ps(one, m[j]);
      nextv = _mm256_add_ps(_mm256_mul_ps(v[j], m[j]), _mm256_mul_ps(keep, nextv));
      last = _mm256_add_ps(_mm256_mul_ps(g, m[j]), _mm256_mul_ps(keep, last));
      r[j] = last;                         // advantages
      v[j] = _mm256_add_ps(last, v[j]);    // returns
    }
    for (int64_t h = 0; h < kBlock; h += 8) {
      store_block(adv, T, t0 + h, r + h);
      store_block(ret, T, t0 + h, v + h);
    }
  }
  alignas(32) float nv[8], la[8];
  _mm256_store_ps(nv, nextv);
  _mm256_store_ps(la, last);
  for (int k = 0; k < 8; ++k) {  // the first t1 < 16 steps of each row
    for (int64_t t = t1 - 1; t >= 0; --t) {
      const int64_t i = k * T + t;
      const float av = gae_step<float>(rew[i], val[i], msk[i], gamma, gl, nv[k], la[k]);
      adv[i] = av;
      ret[i] = av + val[i];
    }
  }
}

}  // namespace avx2
}  // namespace hybridrl

#pragma GCC pop_options
