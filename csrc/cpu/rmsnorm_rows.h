// Per-row fp32 loops of the CPU RMSNorm kernels (rmsnorm_cpu.cpp), written on explicit SIMD
// vectors (the GCC/Clang vector extension). Included once per CPU ISA inside a namespace that
// defines `kVecBytes` (64 AVX-512, 32 AVX2, 16 baseline), under a matching `#pragma GCC target`;
// no include guard on purpose.
//
// Same bits on every ISA path: a row's sums run on kSumLanes (32) virtual lanes whatever the
// vector width (element i goes to lane i % 32, lanes summed in the order of i), and the 32 lanes
// are then added as a fixed tree (halves first); the elementwise formulas are the same ops in the
// same order, without FMA (the extension is built with -ffp-contract=off).

constexpr int64_t kLanes = kVecBytes / 4;
constexpr int64_t kVecs = kSumLanes / kLanes;  // vectors per 32-lane block
typedef float vfloat __attribute__((vector_size(kVecBytes)));

inline vfloat vload(const float* p) {
  vfloat v;
  __builtin_memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

inline void vstore(float* p, vfloat v) { __builtin_memcpy(p, &v, sizeof v); }

// lanes[0..32) summed as a tree: lanes[k] += lanes[k + s] for s = 16, 8, 4, 2, 1.
inline float tree_sum(float* lanes) {
  for (int64_t s = kSumLanes / 2; s >= 1; s /= 2) {
    for (int64_t k = 0; k < s; ++k) lanes[k] += lanes[k + s];
  }
  return lanes[0];
}

// sum over i of x[i] * x[i] (lane order above).
inline float row_sumsq(const float* x, int64_t n) {
  vfloat acc[kVecs] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int64_t v = 0; v < kVecs; ++v) {
      const vfloat a = vload(x + i + v * kLanes);
      acc[v] += a * a;
    }
  }
  float lanes[kSumLanes];
  for (int64_t v = 0; v < kVecs; ++v) vstore(lanes + v * kLanes, acc[v]);
  for (int64_t k = 0; i + k < n; ++k) lanes[k] += x[i + k] * x[i + k];
  return tree_sum(lanes);
}

// out[i] = (x[i] * rstd) * w[i] (w null: x[i] * rstd).
inline void row_scale(const float* x, const float* w, float rstd, float* out, int64_t n) {
  int64_t i = 0;
  if (w != nullptr) {
    for (; i + kLanes <= n; i += kLanes) vstore(out + i, (vload(x + i) * rstd) * vload(w + i));
    for (; i < n; ++i) out[i] = (x[i] * rstd) * w[i];
  } else {
    for (; i + kLanes <= n; i += kLanes) vstore(out + i, vload(x + i) * rstd);
    for (; i < n; ++i) out[i] = x[i] * rstd;
  }
}

// Backward, first pass over a row: returns sum over i of (g[i] * w[i]) * (x[i] * rstd), and adds
// g[i] * (x[i] * rstd) into dw[i] when DW (no W: g[i] stands for g[i] * w[i]).
template <bool W, bool DW>
inline float row_dot(const float* g, const float* w, const float* x, float rstd, float* dw,
                     int64_t n) {
  vfloat acc[kVecs] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int64_t v = 0; v < kVecs; ++v) {
      const int64_t j = i + v * kLanes;
      const vfloat gv = vload(g + j), xh = vload(x + j) * rstd;
      if constexpr (W) {
        acc[v] += (gv * vload(w + j)) * xh;
      } else {
        acc[v] += gv * xh;
      }
      if constexpr (DW) vstore(dw + j, vload(dw + j) + gv * xh);
    }
  }
  float lanes[kSumLanes];
  for (int64_t v = 0; v < kVecs; ++v) vstore(lanes + v * kLanes, acc[v]);
  for (int64_t k = 0; i + k < n; ++k) {
    const int64_t j = i + k;
    const float xh = x[j] * rstd;
    const float gw = W ? g[j] * w[j] : g[j];
    lanes[k] += gw * xh;
    if constexpr (DW) dw[j] += g[j] * xh;
  }
  return tree_sum(lanes);
}

// Backward, second pass: dx[i] = ((g[i] * w[i]) - (x[i] * rstd) * dot) * rstd, dot the row's
// mean of (g * w) * xhat.
inline void row_dx(const float* g, const float* w, const float* x, float rstd, float dot,
                   float* dx, int64_t n) {
  int64_t i = 0;
  if (w != nullptr) {
    for (; i + kLanes <= n; i += kLanes) {
      const vfloat gw = vload(g + i) * vload(w + i);
      vstore(dx + i, (gw - (vload(x + i) * rstd) * dot) * rstd);
    }
    for (; i < n; ++i) dx[i] = ((g[i] * w[i]) - (x[i] * rstd) * dot) * rstd;
  } else {
    for (; i + kLanes <= n; i += kLanes) {
      vstore(dx + i, (vload(g + i) - (vload(x + i) * rstd) * dot) * rstd);
    }
    for (; i < n; ++i) dx[i] = (g[i] - (x[i] * rstd) * dot) * rstd;
  }
}

// acc[i] += part[i] over n elements (the weight-gradient reduction across row blocks).
inline void row_add(float* acc, const float* part, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(acc + i, vload(acc + i) + vload(part + i));
  for (; i < n; ++i) acc[i] += part[i];
}

// One row forward: returns rstd = 1 / sqrt(sum(x^2) / n + eps) and writes out.
float fwd_row(const float* x, const float* w, float eps, float* out, int64_t n) {
  const float rstd = 1.0f / std::sqrt(row_sumsq(x, n) / static_cast<float>(n) + eps);
  row_scale(x, w, rstd, out, n);
  return rstd;
}

// One row backward: dx, and g * xhat added into dw when dw is not null (needs w).
void bwd_row(const float* g, const float* x, float rstd, const float* w, float* dx, float* dw,
             int64_t n) {
  const float sum = w == nullptr ? row_dot<false, false>(g, w, x, rstd, dw, n)
                    : dw == nullptr ? row_dot<true, false>(g, w, x, rstd, dw, n)
                                    : row_dot<true, true>(g, w, x, rstd, dw, n);
  row_dx(g, w, x, rstd, sum / static_cast<float>(n), dx, n);
}
