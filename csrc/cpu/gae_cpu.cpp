// CPU kernel of hybridrl::gae: one reverse pass per row of verl's recurrence (common.h gae_step),
// rows split over threads in chunks claimed from an atomic counter (claim_parallel). Full groups
// of 8 rows go through a row-vectorized loop: for fp32 on AVX2 machines the register-transposed
// loop of gae_avx2.h, otherwise the tiled loop of gae_tiles.h (compiled for AVX-512, AVX2 and
// the baseline ISA, picked at run time); leftover rows walk alone. fp32 math for fp32/bf16/fp16,
// double for fp64; built with -ffp-contract=off, so fp32 results are bit-identical to the
// reference loop.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>

#include "../common.h"
#include "gae_avx2.h"

namespace hybridrl {
namespace isa_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")
#include "gae_tiles.h"
#pragma GCC pop_options
}  // namespace isa_avx512
namespace isa_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "gae_tiles.h"
#pragma GCC pop_options
}  // namespace isa_avx2
namespace isa_base {
#include "gae_tiles.h"
}  // namespace isa_base

namespace {

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t>
using TileFn = void (*)(const scalar_t*, const scalar_t*, const scalar_t*, scalar_t*, scalar_t*,
                        int64_t, acc_type<scalar_t>, acc_type<scalar_t>);

template <typename scalar_t>
TileFn<scalar_t> pick_tile() {
  using acc_t = acc_type<scalar_t>;
  __builtin_cpu_init();
  if constexpr (std::is_same_v<scalar_t, float>) {  // register-transposed AVX2 loop, fastest
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &avx2::gae_rows8;
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return &isa_avx512::gae_tile_rows<scalar_t, acc_t>;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return &isa_avx2::gae_tile_rows<scalar_t, acc_t>;
  }
  return &isa_base::gae_tile_rows<scalar_t, acc_t>;
}

// fn(i0, i1) over [0, n) in chunks of `chunk` items, each claimed from an atomic counter by
// whichever thread is free. at::parallel_for's equal static split makes every call wait for its
// slowest thread; on a shared machine the worker thread just woken from idle (or whose core
// another tenant is using) is often slower, and claiming lets the other take more chunks.
template <typename F>
void claim_parallel(int64_t n, int64_t chunk, const F& fn) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), chunks);
  if (workers <= 1 || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(chunk, std::memory_order_relaxed)) < n;) {
      fn(i, std::min(n, i + chunk));
    }
  });
}

// One row alone (rows left over after the tiles).
template <typename scalar_t>
void gae_one_row(const scalar_t* rew, const scalar_t* val, const scalar_t* msk, scalar_t* adv,
                 scalar_t* ret, int64_t T, acc_type<scalar_t> gamma, acc_type<scalar_t> gl) {
  using acc_t = acc_type<scalar_t>;
  acc_t nextv = 0, last = 0;
  for (int64_t t = T - 1; t >= 0; --t) {
    const acc_t v = static_cast<acc_t>(val[t]);
    const acc_t a = gae_step<acc_t>(static_cast<acc_t>(rew[t]), v, static_cast<acc_t>(msk[t]),
                                    gamma, gl, nextv, last);
    adv[t] = static_cast<scalar_t>(a);
    ret[t] = static_cast<scalar_t>(a + v);
  }
}

void check_gae(const at::Tensor& rew, const at::Tensor& val, const at::Tensor& msk) {
  TORCH_CHECK_VALUE(val.dim() == 2, "values must be 2-D [B, T], got ", val.sizes());
  TORCH_CHECK_VALUE(rew.sizes() == val.sizes() && msk.sizes() == val.sizes(),
                    "rewards, values and mask must share the shape ", val.sizes());
  TORCH_CHECK_VALUE(
      rew.scalar_type() == val.scalar_type() && msk.scalar_type() == val.scalar_type(),
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
    const TileFn<scalar_t> tile = pick_tile<scalar_t>();
    constexpr int64_t L = isa_base::kLanes;
    const int64_t groups = (B + L - 1) / L;  // parallel over groups of L rows
    const int64_t grain = std::max<int64_t>(1, (1 << 15) / (L * std::max<int64_t>(T, 1)));
    claim_parallel(groups, grain, [&](int64_t g0, int64_t g1) {
      for (int64_t grp = g0; grp < g1; ++grp) {
        const int64_t b0 = grp * L, off = b0 * T;
        if (b0 + L <= B) {
          tile(r + off, v + off, m + off, a + off, o + off, T, g, gl);
        } else {
          for (int64_t b = b0; b < B; ++b) {
            gae_one_row<scalar_t>(r + b * T, v + b * T, m + b * T, a + b * T, o + b * T, T, g, gl);
          }
        }
      }
    });
  });
  return {adv, ret};
}

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, CPU, m) { m.impl("gae", &hybridrl::gae_cpu); }
