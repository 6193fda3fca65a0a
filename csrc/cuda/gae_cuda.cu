// CUDA kernel of hybridrl::gae: a chunked parallel scan of the GAE linear recurrence.
//
// Walking t backwards, the state s = (x = nextv, y = last) evolves by an affine map per step
// (derived from common.h gae_step; m = mask, v = value, r = reward, gl = gamma * lam):
//   x_t = (1 - m) x + m v
//   y_t = m gamma x + (m gl + 1 - m) y + m (r - v)
// i.e. s_t = A_t s_{t+1} + b_t with A_t lower triangular; compositions of such maps keep that
// form (Affine below, 5 numbers). kRowThreads threads own one row and walk it from the end in
// segments of kRowThreads * kChunk steps; a block holds blockDim.x / kRowThreads rows (the launch
// shape comes from gae_plan.h, by T and B). Per segment:
//   (1) coalesced load of rewards, values, mask into shared memory (fp32/fp64 math values);
//   (2) each thread composes the maps of its kChunk steps (thread 0 of a row: the latest chunk);
//   (3) an exclusive scan over the row's threads (warp shuffles, then across the row's warps)
//       gives each thread the composition of all later chunks; applied to the carried state it
//       is the thread's incoming state;
//   (4) each thread re-runs the exact recurrence over its chunk, writing advantages and returns
//       to shared memory, stored coalesced;
//   (5) the carry advances through the whole segment (the scan's total).
// A masked-out step is the identity map, which also pads the first, partial segment and the
// rows past B of the last block. Shared memory is skewed by one word every 128 bytes
// (skew() below): the coalesced phases touch 32 consecutive words per warp and the per-thread
// chunk phases (stride kChunk) hit 32 distinct banks, fp32 and fp64 alike.
// tests/unit/gae_cuda_emulation.py is this kernel in NumPy, step for step (bit-exact in fp32).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../common.h"
#include "cuda_utils.cuh"
#include "gae_plan.h"

namespace hybridrl {
namespace {

constexpr int kMaxWarps = kGaeMaxThreads / 32;

// Shared-memory word of segment element i: one padding word after every 128 bytes.
template <typename acc_t>
__device__ __forceinline__ int skew(int i) {
  constexpr int kWordsPer128B = 128 / static_cast<int>(sizeof(acc_t));
  return i + i / kWordsPer128B;
}

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

constexpr unsigned kAllLanes = 0xffffffffu;

template <typename acc_t>
__device__ __forceinline__ Affine<acc_t> shfl_up(const Affine<acc_t>& f, int offset) {
  return {__shfl_up_sync(kAllLanes, f.a, offset), __shfl_up_sync(kAllLanes, f.b, offset),
          __shfl_up_sync(kAllLanes, f.c, offset), __shfl_up_sync(kAllLanes, f.d, offset),
          __shfl_up_sync(kAllLanes, f.e, offset)};
}

template <typename acc_t>
__device__ __forceinline__ Affine<acc_t> shfl_from(const Affine<acc_t>& f, int lane) {
  return {__shfl_sync(kAllLanes, f.a, lane), __shfl_sync(kAllLanes, f.b, lane),
          __shfl_sync(kAllLanes, f.c, lane), __shfl_sync(kAllLanes, f.d, lane),
          __shfl_sync(kAllLanes, f.e, lane)};
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

// Exclusive scan over the kRowWarps * 32 threads of one row (lt = thread within the row);
// *total receives the composition of all of them. warp_tot: this row's kRowWarps slots. All
// threads of the block call it (it holds two __syncthreads when kRowWarps > 1).
template <typename acc_t, int kRowWarps>
__device__ __forceinline__ Affine<acc_t> row_exclusive_scan(const Affine<acc_t>& f,
                                                            Affine<acc_t>* warp_tot, int lt,
                                                            Affine<acc_t>* total) {
  const int lane = lt % 32, warp = lt / 32;
  const Affine<acc_t> incl = warp_scan(f, lane);
  Affine<acc_t> excl = shfl_up(incl, 1);
  if (lane == 0) excl = identity_map<acc_t>();
  if constexpr (kRowWarps == 1) {
    *total = shfl_from(incl, 31);
  } else {
    if (lane == 31) warp_tot[warp] = incl;
    __syncthreads();
    if (warp == 0) {  // each row's first warp scans that row's warp totals
      Affine<acc_t> w = lane < kRowWarps ? warp_tot[lane] : identity_map<acc_t>();
      w = warp_scan(w, lane);
      if (lane < kRowWarps) warp_tot[lane] = w;
    }
    __syncthreads();
    if (warp > 0) excl = compose(excl, warp_tot[warp - 1]);
    *total = warp_tot[kRowWarps - 1];
  }
  return excl;
}

template <typename scalar_t, int kRowThreads, int kChunk>
__global__ void __launch_bounds__(kGaeMaxThreads)
gae_scan_kernel(const scalar_t* __restrict__ rew, const scalar_t* __restrict__ val,
                const scalar_t* __restrict__ msk, scalar_t* __restrict__ adv,
                scalar_t* __restrict__ ret, int64_t B, int64_t T, cuda_acc_t<scalar_t> gamma,
                cuda_acc_t<scalar_t> gl) {
  using acc_t = cuda_acc_t<scalar_t>;
  constexpr int kSeg = kRowThreads * kChunk;  // steps of one row per segment
  constexpr int kRowWords = kSeg + kSeg * static_cast<int>(sizeof(acc_t)) / 128;
  constexpr int kMaxRows = kGaeMaxThreads / kRowThreads;
  __shared__ acc_t s_r[kMaxRows * kRowWords], s_v[kMaxRows * kRowWords],
      s_m[kMaxRows * kRowWords];
  __shared__ Affine<acc_t> warp_tot[kMaxWarps];
  const int slot = static_cast<int>(threadIdx.x) / kRowThreads;  // row slot in the block
  const int lt = static_cast<int>(threadIdx.x) % kRowThreads;     // thread within the row
  const int q = kRowThreads - 1 - lt;  // chunk index within the segment: lt 0 = latest chunk
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kRowThreads) + slot;
  const bool live = row < B;
  const int64_t first = live ? row * T : 0;
  acc_t* r_row = s_r + slot * kRowWords;
  acc_t* v_row = s_v + slot * kRowWords;
  acc_t* m_row = s_m + slot * kRowWords;
  Affine<acc_t>* row_tot = warp_tot + slot * (kRowThreads / 32);
  acc_t carry_x = acc_t(0), carry_y = acc_t(0);  // bootstrap after the last token
  for (int64_t seg_end = T; seg_end > 0; seg_end -= kSeg) {
    const int64_t t0 = seg_end - kSeg;  // may be negative: padded with identity steps
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const int i = lt + k * kRowThreads;
      const int64_t t = t0 + i;
      const bool ok = live && t >= 0;
      r_row[skew<acc_t>(i)] = ok ? static_cast<acc_t>(rew[first + t]) : acc_t(0);
      v_row[skew<acc_t>(i)] = ok ? static_cast<acc_t>(val[first + t]) : acc_t(0);
      m_row[skew<acc_t>(i)] = ok ? static_cast<acc_t>(msk[first + t]) : acc_t(0);
    }
    __syncthreads();
    Affine<acc_t> chunk = identity_map<acc_t>();
#pragma unroll
    for (int k = kChunk - 1; k >= 0; --k) {
      const int s = skew<acc_t>(q * kChunk + k);
      chunk = compose(step_map(r_row[s], v_row[s], m_row[s], gamma, gl), chunk);
    }
    Affine<acc_t> total;
    const Affine<acc_t> later =
        row_exclusive_scan<acc_t, kRowThreads / 32>(chunk, row_tot, lt, &total);
    acc_t x = later.a * carry_x + later.b;
    acc_t y = later.c * carry_x + later.d * carry_y + later.e;
#pragma unroll
    for (int k = kChunk - 1; k >= 0; --k) {
      const int s = skew<acc_t>(q * kChunk + k);
      const acc_t v = v_row[s];
      const acc_t a = gae_step<acc_t>(r_row[s], v, m_row[s], gamma, gl, x, y);
      r_row[s] = a;
      v_row[s] = a + v;
    }
    const acc_t next_y = total.c * carry_x + total.d * carry_y + total.e;
    carry_x = total.a * carry_x + total.b;
    carry_y = next_y;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const int i = lt + k * kRowThreads;
      const int64_t t = t0 + i;
      if (live && t >= 0) {
        adv[first + t] = static_cast<scalar_t>(r_row[skew<acc_t>(i)]);
        ret[first + t] = static_cast<scalar_t>(v_row[skew<acc_t>(i)]);
      }
    }
    __syncthreads();
  }
}

template <typename scalar_t, int kRowThreads, int kChunk>
void launch_gae(const GaePlan& plan, const at::Tensor& rew, const at::Tensor& val,
                const at::Tensor& msk, at::Tensor& adv, at::Tensor& ret, double gamma,
                double lam) {
  using acc_t = cuda_acc_t<scalar_t>;
  const int threads = plan.rows_per_block * kRowThreads;
  gae_scan_kernel<scalar_t, kRowThreads, kChunk>
      <<<static_cast<unsigned>(plan.blocks), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          rew.const_data_ptr<scalar_t>(), val.const_data_ptr<scalar_t>(),
          msk.const_data_ptr<scalar_t>(), adv.mutable_data_ptr<scalar_t>(),
          ret.mutable_data_ptr<scalar_t>(), val.size(0), val.size(1),
          static_cast<acc_t>(gamma), static_cast<acc_t>(gamma * lam));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The six launch shapes plan_gae can return, for one dtype (full = 8 or 4 steps per thread).
template <typename scalar_t>
void dispatch_gae(const GaePlan& plan, const at::Tensor& rew, const at::Tensor& val,
                  const at::Tensor& msk, at::Tensor& adv, at::Tensor& ret, double gamma,
                  double lam) {
  constexpr int full = sizeof(cuda_acc_t<scalar_t>) == 8 ? 4 : 8, half = full / 2;
  TORCH_INTERNAL_ASSERT(plan.chunk == full || plan.chunk == half, "gae plan: chunk ", plan.chunk);
  const bool is_full = plan.chunk == full;
  switch (plan.row_threads) {
    case 32:
      return is_full ? launch_gae<scalar_t, 32, full>(plan, rew, val, msk, adv, ret, gamma, lam)
                     : launch_gae<scalar_t, 32, half>(plan, rew, val, msk, adv, ret, gamma, lam);
    case 64: return launch_gae<scalar_t, 64, full>(plan, rew, val, msk, adv, ret, gamma, lam);
    case 128: return launch_gae<scalar_t, 128, full>(plan, rew, val, msk, adv, ret, gamma, lam);
    default:
      return is_full ? launch_gae<scalar_t, 256, full>(plan, rew, val, msk, adv, ret, gamma, lam)
                     : launch_gae<scalar_t, 256, half>(plan, rew, val, msk, adv, ret, gamma, lam);
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, val.scalar_type(), "gae_cuda", [&] {
    const int acc_bytes = static_cast<int>(sizeof(cuda_acc_t<scalar_t>));
    const GaePlan plan = plan_gae(B, T, acc_bytes, sm_count(val.get_device()));
    TORCH_CHECK_VALUE(plan.blocks <= INT32_MAX, "values: too many rows for one launch, got ", B);
    dispatch_gae<scalar_t>(plan, rew, val, msk, adv, ret, gamma, lam);
  });
  return {adv, ret};
}

}  // namespace
}  // namespace hybridrl

TORCH_LIBRARY_IMPL(hybridrl, CUDA, m) { m.impl("gae", &hybridrl::gae_cuda); }
