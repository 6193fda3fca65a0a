// CPU kernels of hybridrl::rms_norm_fwd / rms_norm_bwd: RMSNorm over the last dim of a tensor of
// any leading shape, one fused pass per row forward (sum of squares, then scale) and two per row
// backward (the dot term and the weight-gradient row, then dx), fp32 math for fp32/bf16/fp16
// (bf16/fp16 widened per row into fp32 buffers, results rounded once to the input dtype).
//
//   rstd = 1 / sqrt(mean(x^2) + eps)                     [rows], fp32
//   out  = (x * rstd) * w                                dtype of x
//   dx   = (g * w - xhat * mean(g * w * xhat)) * rstd    xhat = x * rstd
//   dw   = sum over rows of g * xhat                     fp32 sums, dtype of weight
//
// The weight gradient is summed in fixed blocks of rows (each block's partial row in fp32, then
// the blocks in order), so its bits do not depend on the thread count. The row loops
// (rmsnorm_rows.h) are compiled for AVX-512, AVX2 and the baseline ISA (`#pragma GCC target`, as
// in kl_cpu.cpp) and give the same bits on every path; the best path the CPU runs is picked at
// the first call, HYBRIDRL_CPU_ISA forces one, the ops' `isa` argument picks one per call (the
// tests run every path in one process) and rms_norm_cpu_isa() names the default.
// Schemas are defined here (a TORCH_LIBRARY_FRAGMENT of csrc/ops.cpp's library).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "isa_select.h"

namespace hybridrl {
constexpr int64_t kSumLanes = 32;  // virtual lanes of a row's sums (rmsnorm_rows.h)

#if defined(__x86_64__) || defined(__i386__)
#define HR_RMS_X86 1
namespace rms_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
constexpr int kVecBytes = 64;
#include "rmsnorm_rows.h"
#pragma GCC pop_options
}  // namespace rms_avx512
namespace rms_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
constexpr int kVecBytes = 32;
#include "rmsnorm_rows.h"
#pragma GCC pop_options
}  // namespace rms_avx2
#endif
namespace rms_base {  // the build's baseline ISA: SSE2 on x86-64, NEON on aarch64
constexpr int kVecBytes = 16;
#include "rmsnorm_rows.h"
}  // namespace rms_base

namespace {

// One ISA's row functions.
struct RmsPath {
  const char* name;
  float (*fwd_row)(const float*, const float*, float, float*, int64_t);
  void (*bwd_row)(const float*, const float*, float, const float*, float*, float*, int64_t);
  void (*add)(float*, const float*, int64_t);
};

#define HR_RMS_PATH(name, ns) RmsPath{name, &ns::fwd_row, &ns::bwd_row, &ns::row_add}

// The paths this CPU can run, best first; the baseline is always last (kl_cpu.cpp's rule).
std::vector<RmsPath> available_paths() {
  std::vector<RmsPath> paths;
#ifdef HR_RMS_X86
  const isa_select::SimdLevels cpu = isa_select::cpu_simd_levels();
  if (cpu.avx512) paths.push_back(HR_RMS_PATH("avx512", rms_avx512));
  if (cpu.avx2) paths.push_back(HR_RMS_PATH("avx2", rms_avx2));
#endif
  paths.push_back(HR_RMS_PATH("baseline", rms_base));
  return paths;
}

// The path named `want` ("" or "auto": the best); `source` names where the name came from.
RmsPath find_path(const std::string& want, const char* source) {
  return isa_select::pick_isa_path(available_paths(), want, source, "an RMSNorm");
}

// The default path: HYBRIDRL_CPU_ISA (read once, at the first call) or the best.
const RmsPath& default_path() {
  static const RmsPath path = find_path(isa_select::isa_env(), "HYBRIDRL_CPU_ISA=");
  return path;
}

RmsPath pick_path(c10::string_view isa) {
  const std::string want(isa.data(), isa.size());
  return want == "auto" ? default_path() : find_path(want, "isa=");
}

constexpr int64_t kGrainElems = 1 << 15;  // elements per parallel task

// Row i of a contiguous [rows, n] matrix of T as fp32: the row itself for float, else widened
// into buf.
template <typename T>
const float* row_f32(const T* base, int64_t i, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return base + i * n;
  } else {
    const T* src = base + i * n;
    for (int64_t k = 0; k < n; ++k) buf[k] = static_cast<float>(src[k]);
    return buf;
  }
}

// fp32 weight (null when absent): the weight itself for float, else a widened copy.
const float* weight_f32(const at::Tensor& w, at::Tensor& keep) {
  if (!w.defined()) return nullptr;
  keep = w.scalar_type() == at::kFloat ? w.contiguous() : w.to(at::kFloat).contiguous();
  return keep.const_data_ptr<float>();
}

void check_x(const at::Tensor& x, const c10::optional<at::Tensor>& weight, const char* op) {
  const auto t = x.scalar_type();
  TORCH_CHECK_VALUE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, op,
                    ": x must be float32, bfloat16 or float16, got ", t);
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least one dimension");
  if (weight.has_value() && weight->defined()) {
    TORCH_CHECK_VALUE(weight->dim() == 1 && weight->size(0) == x.size(-1), op,
                      ": weight must have shape [", x.size(-1), "] (the last dim of x), got ",
                      weight->sizes());
    // fp32 with 16-bit x is megatron's local spec (norm weights kept in fp32): the math is fp32
    // either way, dw comes back in the weight's dtype
    TORCH_CHECK_VALUE(weight->scalar_type() == t || weight->scalar_type() == at::kFloat, op,
                      ": weight must have the dtype of x (", t, ") or float32, got ",
                      weight->scalar_type());
    TORCH_CHECK_VALUE(weight->device() == x.device(), op, ": weight must be on x's device");
  }
}

// Number of rows (the product of the leading dims, also when the last dim is 0).
int64_t leading_rows(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

template <typename T>
void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<T>(src[k]);
}

// Forward of rows [begin, end): out rows in T, rstd in fp32.
template <typename T>
void fwd_rows(const RmsPath& path, const T* x, const float* w, float eps, T* out, float* rstd,
              int64_t n, int64_t begin, int64_t end) {
  std::vector<float> xbuf, obuf;
  if constexpr (!std::is_same_v<T, float>) xbuf.resize(n), obuf.resize(n);
  for (int64_t i = begin; i < end; ++i) {
    const float* xr = row_f32(x, i, n, xbuf.data());
    if constexpr (std::is_same_v<T, float>) {
      rstd[i] = path.fwd_row(xr, w, eps, out + i * n, n);
    } else {
      rstd[i] = path.fwd_row(xr, w, eps, obuf.data(), n);
      store_row(obuf.data(), out + i * n, n);
    }
  }
}

// Backward of row blocks [b0, b1) of `block` rows each: dx rows in T, block b's weight-gradient
// row summed into partial + b * n (partial null: no weight).
template <typename T>
void bwd_blocks(const RmsPath& path, const T* g, const T* x, const float* rstd, const float* w,
                T* dx, float* partial, int64_t n, int64_t rows, int64_t block, int64_t b0,
                int64_t b1) {
  std::vector<float> xbuf, gbuf, dbuf;
  if constexpr (!std::is_same_v<T, float>) xbuf.resize(n), gbuf.resize(n), dbuf.resize(n);
  for (int64_t b = b0; b < b1; ++b) {
    float* dw = partial != nullptr ? partial + b * n : nullptr;
    for (int64_t i = b * block; i < std::min(rows, (b + 1) * block); ++i) {
      const float* xr = row_f32(x, i, n, xbuf.data());
      const float* gr = row_f32(g, i, n, gbuf.data());
      if constexpr (std::is_same_v<T, float>) {
        path.bwd_row(gr, xr, rstd[i], w, dx + i * n, dw, n);
      } else {
        path.bwd_row(gr, xr, rstd[i], w, dbuf.data(), dw, n);
        store_row(dbuf.data(), dx + i * n, n);
      }
    }
  }
}

// fn(T{}) for T the C++ type of x's dtype (fp32, bf16, fp16; check_x rejects the others).
template <typename Fn>
void dispatch_dtype(at::ScalarType t, Fn&& fn) {
  if (t == at::kFloat) return fn(float{});
  if (t == at::kBFloat16) return fn(c10::BFloat16{});
  return fn(c10::Half{});
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& x_in,
                                                    const c10::optional<at::Tensor>& weight,
                                                    double eps, c10::string_view isa) {
  check_x(x_in, weight, "rms_norm_fwd");
  const RmsPath path = pick_path(isa);
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(-1), rows = leading_rows(x);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  at::Tensor w_keep;
  const float* w = weight_f32(weight.has_value() ? *weight : at::Tensor(), w_keep);
  const float eps_f = static_cast<float>(eps);
  float* r = rstd.mutable_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(n, 1));
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    T* op = out.mutable_data_ptr<T>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      fwd_rows<T>(path, xp, w, eps_f, op, r, n, begin, end);
    });
  });
  return {out, rstd};
}

std::tuple<at::Tensor, c10::optional<at::Tensor>> rms_norm_bwd_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& rstd_in,
    const c10::optional<at::Tensor>& weight, c10::string_view isa) {
  check_x(x_in, weight, "rms_norm_bwd");
  TORCH_CHECK_VALUE(grad_in.sizes() == x_in.sizes(), "rms_norm_bwd: grad must have the shape of "
                    "x ", x_in.sizes(), ", got ", grad_in.sizes());
  TORCH_CHECK_VALUE(rstd_in.sizes() == x_in.sizes().slice(0, x_in.dim() - 1), "rms_norm_bwd: "
                    "rstd must have the leading shape of x, got ", rstd_in.sizes());
  const RmsPath path = pick_path(isa);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor grad = grad_in.to(x.scalar_type()).contiguous();
  const at::Tensor rstd = rstd_in.to(at::kFloat).contiguous();
  const int64_t n = x.size(-1), rows = leading_rows(x);
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor w_keep;
  const bool has_w = weight.has_value() && weight->defined();
  const float* w = weight_f32(has_w ? *weight : at::Tensor(), w_keep);
  // weight gradient: blocks of `block` rows, each summed into its own fp32 row of `partial`
  const int64_t block = std::max<int64_t>(64, (rows + 255) / 256);
  const int64_t blocks = (rows + block - 1) / block;
  std::vector<float> partial(has_w ? std::max<int64_t>(blocks, 1) * n : 0, 0.0f);
  float* part = has_w ? partial.data() : nullptr;
  const float* rs = rstd.const_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(block * n, 1));
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    const T* gp = grad.const_data_ptr<T>();
    T* dp = dx.mutable_data_ptr<T>();
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      bwd_blocks<T>(path, gp, xp, rs, w, dp, part, n, rows, block, b0, b1);
    });
  });
  if (!has_w) return {dx, c10::nullopt};
  for (int64_t b = 1; b < blocks; ++b) path.add(partial.data(), partial.data() + b * n, n);
  at::Tensor dw = at::empty({n}, x.options().dtype(at::kFloat));
  std::copy(partial.begin(), partial.begin() + n, dw.mutable_data_ptr<float>());
  return {dx, dw.to(weight->scalar_type())};
}

}  // namespace

// Name of the default path of the RMSNorm kernels ("avx512", "avx2", "baseline").
std::string rms_norm_cpu_isa() { return default_path().name; }

}  // namespace hybridrl

TORCH_LIBRARY_FRAGMENT(hybridrl, m) {
  // RMSNorm over the last dim: (out in x's dtype, rstd [leading shape] fp32). `isa` picks the
  // CPU SIMD path ("auto": the default one, see rms_norm_cpu_isa).
  m.def("rms_norm_fwd(Tensor x, Tensor? weight, float eps, str isa=\"auto\") -> (Tensor, Tensor)");
  // (dx in x's dtype, dweight in weight's dtype; None without weight)
  m.def("rms_norm_bwd(Tensor grad, Tensor x, Tensor rstd, Tensor? weight, str isa=\"auto\")"
        " -> (Tensor, Tensor?)");
  // The default SIMD path of the CPU RMSNorm kernels; HYBRIDRL_CPU_ISA (read at the first call)
  // forces one.
  m.def("rms_norm_cpu_isa() -> str", &hybridrl::rms_norm_cpu_isa);
}

TORCH_LIBRARY_IMPL(hybridrl, CPU, m) {
  m.impl("rms_norm_fwd", &hybridrl::rms_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &hybridrl::rms_norm_bwd_cpu);
}
