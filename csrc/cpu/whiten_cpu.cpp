// CPU kernel of hybridrl::masked_whiten: three fused passes (masked sum + count, masked centered
// sum of squares, normalize). Each pass splits the tensor into fixed kChunk-element chunks whose
// partials are summed in chunk order, so the result does not depend on the thread count. Inside
// a chunk, runs of kSub elements are summed by a vectorized (omp simd) reduction and folded into
// double. Element math is fp32 for
// fp32/bf16/fp16 and double for fp64, as in the reference.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../common.h"

namespace hybridrl {
namespace {

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

constexpr int64_t kChunk = 1 << 14;
constexpr int64_t kSub = 256;  // short fp32 runs: rounding stays far below the reference's

// Sum over chunks (in chunk order) of f(begin, end) -> {x, y}.
template <typename F>
std::pair<double, double> chunked_sum(int64_t n, const F& f) {
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<double> xs(nchunks), ys(nchunks);
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const auto xy = f(c * kChunk, std::min(n, (c + 1) * kChunk));
      xs[c] = xy.first;
      ys[c] = xy.second;
    }
  });
  double x = 0, y = 0;
  for (int64_t c = 0; c < nchunks; ++c) x += xs[c], y += ys[c];
  return {x, y};
}

// mi != 0 ? x : 0 without a branch (a random mask mispredicts one per element otherwise).
template <typename acc_t>
inline acc_t keep_if_nonzero(acc_t mi, acc_t x) {
  using bits_t = std::conditional_t<sizeof(acc_t) == 8, uint64_t, uint32_t>;
  const bits_t keep = bits_t(0) - static_cast<bits_t>(mi != acc_t(0));  // all ones or zero
  return __builtin_bit_cast(acc_t, __builtin_bit_cast(bits_t, x) & keep);
}

// (sum over [b, e) of term(i), sum of mask): kSub-element runs summed with an OpenMP simd
// reduction in acc_t (a fixed lane order, so deterministic), then folded into double.
template <typename scalar_t, typename Term>
std::pair<double, double> sub_sums(const scalar_t* m, int64_t b, int64_t e, const Term& term) {
  using acc_t = acc_type<scalar_t>;
  double x = 0, c = 0;
  for (int64_t s = b; s < e; s += kSub) {
    const int64_t se = std::min(e, s + kSub);
    acc_t xs = 0, cs = 0;
#pragma omp simd reduction(+ : xs, cs)
    for (int64_t i = s; i < se; ++i) {
      xs += term(i);
      cs += static_cast<acc_t>(m[i]);
    }
    x += xs;
    c += cs;
  }
  return {x, c};
}

template <typename scalar_t>
void whiten_impl(const scalar_t* v, const scalar_t* m, scalar_t* out, int64_t n) {
  using acc_t = acc_type<scalar_t>;
  // where(mask != 0, v, 0) * mask, as the reference (NaN outside the mask does not leak in).
  const auto [sum, count] = chunked_sum(n, [&](int64_t b, int64_t e) {
    return sub_sums(m, b, e, [&](int64_t i) {
      const acc_t mi = static_cast<acc_t>(m[i]);
      return keep_if_nonzero(mi, static_cast<acc_t>(v[i]) * mi);
    });
  });
  TORCH_CHECK_VALUE(count != 0.0, "mask: at least one element of the mask has to be 1");
  TORCH_CHECK_VALUE(count != 1.0, "mask: the mask sums to one, the unbiased variance is undefined");
  const acc_t mean = static_cast<acc_t>(sum / (count + 1e-8));
  const double sq = chunked_sum(n, [&](int64_t b, int64_t e) {
    return sub_sums(m, b, e, [&](int64_t i) {
      const acc_t mi = static_cast<acc_t>(m[i]), d = static_cast<acc_t>(v[i]) - mean;
      return keep_if_nonzero(mi, (d * d) * mi);
    });
  }).first;
  const double var = sq / (count + 1e-8) * (count / (count - 1.0));
  const acc_t rstd = static_cast<acc_t>(1.0 / std::sqrt(var + 1e-8));
  at::parallel_for(0, n, kChunk, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      out[i] = static_cast<scalar_t>((static_cast<acc_t>(v[i]) - mean) * rstd);
    }
  });
}

at::Tensor masked_whiten_cpu(const at::Tensor& val_in, const at::Tensor& msk_in) {
  TORCH_CHECK_VALUE(val_in.sizes() == msk_in.sizes(), "mask must have the shape of values ",
                    val_in.sizes(), ", got ", msk_in.sizes());
  TORCH_CHECK_VALUE(val_in.scalar_type() == msk_in.scalar_type(),
                    "values and mask must share a floating dtype");
  const at::Tensor val = val_in.contiguous(), msk = msk_in.contiguous();
  at::Tensor out = at::empty_like(val, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, val.scalar_type(), "whiten_cpu", [&] {
    whiten_impl<scalar_t>(val.const_data_ptr<scalar_t>(), msk.const_data_ptr<scalar_t>(),
                          out.mutable_data_ptr<scalar_t>(), val.numel());
  });
  return out;
}

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, CPU, m) { m.impl("masked_whiten", &hybridrl::masked_whiten_cpu); }
