// CPU kernels of hybridrl::gae and hybridrl::masked_whiten.
// gae: one reverse pass per row (verl's recurrence, common.h gae_step), rows split over threads
//   with at::parallel_for; kRows rows are walked together so their independent recurrences
//   overlap in the pipeline. fp32 math for fp32/bf16/fp16, double for fp64.
// masked_whiten: three fused passes (masked sum + count, masked centered sum of squares,
//   normalize) with fixed-size chunk partials summed in order, so the result does not depend on
//   the thread count; statistics accumulate in double.
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

constexpr int64_t kRows = 8;

// Rows [0, R) of a block starting at the given pointers, each of length T.
template <typename scalar_t, int64_t R>
void gae_block(const scalar_t* rew, const scalar_t* val, const scalar_t* msk, scalar_t* adv,
               scalar_t* ret, int64_t T, acc_type<scalar_t> gamma, acc_type<scalar_t> gl) {
  using acc_t = acc_type<scalar_t>;
  acc_t nextv[R], last[R];
  for (int64_t k = 0; k < R; ++k) nextv[k] = last[k] = acc_t(0);
  for (int64_t t = T - 1; t >= 0; --t) {
    for (int64_t k = 0; k < R; ++k) {
      const int64_t i = k * T + t;
      const acc_t v = static_cast<acc_t>(val[i]);
      const acc_t a = gae_step<acc_t>(static_cast<acc_t>(rew[i]), v, static_cast<acc_t>(msk[i]),
                                      gamma, gl, nextv[k], last[k]);
      adv[i] = static_cast<scalar_t>(a);
      ret[i] = static_cast<scalar_t>(a + v);
    }
  }
}

void check_gae(const at::Tensor& rew, const at::Tensor& val, const at::Tensor& msk) {
  TORCH_CHECK_VALUE(val.dim() == 2, "values must be 2-D [B, T], got ", val.sizes());
  TORCH_CHECK_VALUE(rew.sizes() == val.sizes() && msk.sizes() == val.sizes(),
                    "rewards, values and mask must share the shape ", val.sizes());
  TORCH_CHECK_VALUE(rew.scalar_type() == val.scalar_type() && msk.scalar_type() == val.scalar_type(),
                    "rewards, values and mask must share a floating dtype");
}

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rew_in, const at::Tensor& val_in,
                                           const at::Tensor& msk_in, double gamma, double lam) {
  check_gae(rew_in, val_in, msk_in);
  const at::Tensor rew = rew_in.contiguous(), val = val_in.contiguous(), msk = msk_in.contiguous();
  at::Tensor adv = at::empty_like(val, at::MemoryFormat::Contiguous);
  at::Tensor ret = at::empty_like(val, at::MemoryFormat::Contiguous);
  const int64_t B = val.size(0), T = val.size(1);
  if (val.numel() == 0) return {adv, ret};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, val.scalar_type(), "gae_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    // Python evaluates gamma * lam in double before torch casts the scalar: do the same.
    const acc_t g = static_cast<acc_t>(gamma), gl = static_cast<acc_t>(gamma * lam);
    const scalar_t *r = rew.const_data_ptr<scalar_t>(), *v = val.const_data_ptr<scalar_t>(),
                   *m = msk.const_data_ptr<scalar_t>();
    scalar_t *a = adv.mutable_data_ptr<scalar_t>(), *o = ret.mutable_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(kRows, (1 << 16) / std::max<int64_t>(T, 1));
    at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
      int64_t b = b0;
      for (; b + kRows <= b1; b += kRows) {
        const int64_t off = b * T;
        gae_block<scalar_t, kRows>(r + off, v + off, m + off, a + off, o + off, T, g, gl);
      }
      for (; b < b1; ++b) {
        const int64_t off = b * T;
        gae_block<scalar_t, 1>(r + off, v + off, m + off, a + off, o + off, T, g, gl);
      }
    });
  });
  return {adv, ret};
}

constexpr int64_t kChunk = 1 << 15;

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

template <typename scalar_t>
void whiten_impl(const scalar_t* v, const scalar_t* m, scalar_t* out, int64_t n) {
  using acc_t = acc_type<scalar_t>;
  const auto [sum, count] = chunked_sum(n, [&](int64_t b, int64_t e) {
    double s = 0, c = 0;
    for (int64_t i = b; i < e; ++i) {
      const acc_t mi = static_cast<acc_t>(m[i]);
      s += mi != acc_t(0) ? static_cast<double>(static_cast<acc_t>(v[i]) * mi) : 0.0;
      c += mi;
    }
    return std::make_pair(s, c);
  });
  TORCH_CHECK_VALUE(count != 0.0, "mask: at least one element of the mask has to be 1");
  TORCH_CHECK_VALUE(count != 1.0, "mask: the mask sums to one, the unbiased variance is undefined");
  const acc_t mean = static_cast<acc_t>(sum / (count + 1e-8));
  const auto sq = chunked_sum(n, [&](int64_t b, int64_t e) {
    double q = 0;
    for (int64_t i = b; i < e; ++i) {
      const acc_t mi = static_cast<acc_t>(m[i]);
      const acc_t d = static_cast<acc_t>(v[i]) - mean;
      q += mi != acc_t(0) ? static_cast<double>((d * d) * mi) : 0.0;
    }
    return std::make_pair(q, 0.0);
  });
  const double var = sq.first / (count + 1e-8) * (count / (count - 1.0));
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

TORCH_LIBRARY_IMPL(hybridrl, CPU, m) {
  m.impl("gae", &hybridrl::gae_cpu);
  m.impl("masked_whiten", &hybridrl::masked_whiten_cpu);
}
