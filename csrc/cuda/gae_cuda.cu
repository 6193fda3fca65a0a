// CUDA kernel of hybridrl::gae: a chunked parallel scan of the GAE linear recurrence.
//
// Walking t backwards, the state s = (x = nextv, y = last) evolves by an affine map per step
// (derived from common.h gae_step; m = mask, v = value, r = reward, gl = gamma * lam):
//   x_t = (1 - m) x + m v
//   y_t = m gamma x + (m gl + 1 - m) y + m (r - v)
// i.e. s_t = A_t s_{t+1} + b_t with A_t lower triangular; compositions of such maps keep that
// form (Affine below, 5 numbers). One block owns one row and walks it from the end in segments
// of kThreads * kChunk steps (kChunk = 8 for fp32 math, 4 for fp64). Per segment:
//   (1) coalesced load of rewards, values, mask into shared memory;
//   (2) each thread composes the maps of its kChunk steps (thread 0 owns the latest chunk);
//   (3) a block-wide exclusive scan (warp shuffles, then across warps) gives each thread the
//       composition of all later chunks; applied to the carried state it is the thread's
//       incoming state;
//   (4) each thread re-runs the exact recurrence over its chunk, writing advantages and returns;
//   (5) the carry advances through the whole segment (the scan's total).
// No thread walks more than 2 * kChunk steps per segment, whatever T is. A masked-out step is the
// identity map, which also pads the first, partial segment. hybridrl/kernels/scan.py is the same
// algorithm in torch, checked on CPU against the reference loop (docs/kernels.md).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../common.h"
#include "cuda_utils.cuh"

namespace hybridrl {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Steps per thread per segment: 8 for fp32 math (24 KiB of shared memory), 4 for fp64.
template <typename acc_t>
constexpr int kChunk = sizeof(acc_t) == 8 ? 4 : 8;
template <typename acc_t>
constexpr int kSegment = kThreads * kChunk<acc_t>;

// (x, y) -> (a x + b, c x + d y + e)
template <typename acc_t>
struct Affine {
  acc_t a, b, c, d, e;
};

template <typename acc_t>
__device__ __forceinline__ Affine<acc_t> identity_map() {
  return {acc_t(1), acc_t(0), acc_t(0), acc_t(1), acc_t(0)};
}

// f o g: apply g, then f.
template <typename acc_t>
__device__ __forceinline__ Affine<acc_t> compose(const Affine<acc_t>& f, const Affine<acc_t>& g) {
  return {f.a * g.a, f.a * g.b + f.b, f.c * g.a + f.d * g.c, f.d * g.d,
          f.c * g.b + f.d * g.e + f.e};
}

template <typename acc_t>
__device__ __forceinline__ Affine<acc_t> step_map(acc_t r, acc_t v, acc_t m, acc_t gamma,
                                                  acc_t gl) {
  const acc_t keep = acc_t(1) - m;
  return {keep, m * v, m * gamma, m * gl + keep, m * (r - v)};
}

template <typename acc_t>
__device__ __forceinline__ Affine<acc_t> shfl_up(const Affine<acc_t>& f, int offset) {
  constexpr unsigned kAll = 0xffffffffu;
  return {__shfl_up_sync(kAll, f.a, offset), __shfl_up_sync(kAll, f.b, offset),
          __shfl_up_sync(kAll, f.c, offset), __shfl_up_sync(kAll, f.d, offset),
          __shfl_up_sync(kAll, f.e, offset)};
}

// Inclusive scan over lanes: lane l gets M_l o M_{l-1} o ... o M_0.
template <typename acc_t>
__device__ __forceinline__ Affine<acc_t> warp_scan(Affine<acc_t> f, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const Affine<acc_t> earlier = shfl_up(f, offset);
    if (lane >= offset) f = compose(f, earlier);
  }
  return f;
}

// Exclusive block scan in thread order; *total receives the composition of all threads' maps.
template <typename acc_t>
__device__ Affine<acc_t> block_exclusive_scan(const Affine<acc_t>& f, Affine<acc_t>* warp_tot,
                                              Affine<acc_t>* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Affine<acc_t> incl = warp_scan(f, lane);
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    Affine<acc_t> w = lane < kWarps ? warp_tot[lane] : identity_map<acc_t>();
    w = warp_scan(w, lane);
    if (lane < kWarps) warp_tot[lane] = w;
  }
  __syncthreads();
  Affine<acc_t> excl = shfl_up(incl, 1);
  if (lane == 0) excl = identity_map<acc_t>();
  if (warp > 0) excl = compose(excl, warp_tot[warp - 1]);
  *total = warp_tot[kWarps - 1];
  return excl;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
gae_scan_kernel(const scalar_t* __restrict__ rew, const scalar_t* __restrict__ val,
                const scalar_t* __restrict__ msk, scalar_t* __restrict__ adv,
                scalar_t* __restrict__ ret, int64_t T, cuda_acc_t<scalar_t> gamma,
                cuda_acc_t<scalar_t> gl) {
  using acc_t = cuda_acc_t<scalar_t>;
  constexpr int kChunkA = kChunk<acc_t>, kSegmentA = kSegment<acc_t>;
  __shared__ acc_t s_r[kSegmentA], s_v[kSegmentA], s_m[kSegmentA];
  __shared__ Affine<acc_t> warp_tot[kWarps];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * T;
  const int q = kThreads - 1 - static_cast<int>(threadIdx.x);  // thread 0: the latest chunk
  acc_t carry_x = acc_t(0), carry_y = acc_t(0);                 // bootstrap after the last token
  for (int64_t seg_end = T; seg_end > 0; seg_end -= kSegmentA) {
    const int64_t t0 = seg_end - kSegmentA;  // may be negative: padded with identity steps
    for (int i = threadIdx.x; i < kSegmentA; i += kThreads) {
      const int64_t t = t0 + i;
      const bool ok = t >= 0;
      s_r[i] = ok ? static_cast<acc_t>(rew[row + t]) : acc_t(0);
      s_v[i] = ok ? static_cast<acc_t>(val[row + t]) : acc_t(0);
      s_m[i] = ok ? static_cast<acc_t>(msk[row + t]) : acc_t(0);
    }
    __syncthreads();
    Affine<acc_t> chunk = identity_map<acc_t>();
    for (int k = kChunkA - 1; k >= 0; --k) {
      const int i = q * kChunkA + k;
      chunk = compose(step_map(s_r[i], s_v[i], s_m[i], gamma, gl), chunk);
    }
    Affine<acc_t> total;
    const Affine<acc_t> later = block_exclusive_scan(chunk, warp_tot, &total);
    acc_t x = later.a * carry_x + later.b;
    acc_t y = later.c * carry_x + later.d * carry_y + later.e;
    for (int k = kChunkA - 1; k >= 0; --k) {
      const int i = q * kChunkA + k;
      const acc_t v = s_v[i];
      const acc_t a = gae_step<acc_t>(s_r[i], v, s_m[i], gamma, gl, x, y);
      s_r[i] = a;
      s_v[i] = a + v;
    }
    const acc_t next_y = total.c * carry_x + total.d * carry_y + total.e;
    carry_x = total.a * carry_x + total.b;
    carry_y = next_y;
    __syncthreads();
    for (int i = threadIdx.x; i < kSegmentA; i += kThreads) {
      const int64_t t = t0 + i;
      if (t >= 0) {
        adv[row + t] = static_cast<scalar_t>(s_r[i]);
        ret[row + t] = static_cast<scalar_t>(s_v[i]);
      }
    }
    __syncthreads();
  }
}

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rew_in, const at::Tensor& val_in,
                                            const at::Tensor& msk_in, double gamma, double lam) {
  TORCH_CHECK_VALUE(val_in.dim() == 2, "values must be 2-D [B, T], got ", val_in.sizes());
  TORCH_CHECK_VALUE(rew_in.sizes() == val_in.sizes() && msk_in.sizes() == val_in.sizes(),
                    "rewards, values and mask must share the shape ", val_in.sizes());
  TORCH_CHECK_VALUE(rew_in.scalar_type() == val_in.scalar_type() &&
                        msk_in.scalar_type() == val_in.scalar_type(),
                    "rewards, values and mask must share a floating dtype");
  TORCH_CHECK_VALUE(rew_in.device() == val_in.device() && msk_in.device() == val_in.device(),
                    "rewards, values and mask must be on one device");
  const c10::cuda::CUDAGuard guard(val_in.device());
  const at::Tensor rew = rew_in.contiguous(), val = val_in.contiguous(), msk = msk_in.contiguous();
  at::Tensor adv = at::empty_like(val, at::MemoryFormat::Contiguous);
  at::Tensor ret = at::empty_like(val, at::MemoryFormat::Contiguous);
  const int64_t B = val.size(0), T = val.size(1);
  if (val.numel() == 0) return {adv, ret};
  TORCH_CHECK_VALUE(B <= INT32_MAX, "values: at most 2^31 - 1 rows, got ", B);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, val.scalar_type(), "gae_cuda", [&] {
    using acc_t = cuda_acc_t<scalar_t>;
    gae_scan_kernel<scalar_t><<<static_cast<unsigned>(B), kThreads, 0,
                                c10::cuda::getCurrentCUDAStream()>>>(
        rew.const_data_ptr<scalar_t>(), val.const_data_ptr<scalar_t>(),
        msk.const_data_ptr<scalar_t>(), adv.mutable_data_ptr<scalar_t>(),
        ret.mutable_data_ptr<scalar_t>(), T, static_cast<acc_t>(gamma),
        static_cast<acc_t>(gamma * lam));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {adv, ret};
}

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, CUDA, m) { m.impl("gae", &hybridrl::gae_cuda); }
