// Contiguous float loops of the KL kernels. Included once per CPU ISA (see kl_cpu.cpp) inside a
// namespace under `#pragma GCC target`, so the same source is vectorized for AVX-512, AVX2 and
// the baseline; no include guard on purpose.

template <int64_t KIND>
void kl_fwd_span(const float* lp, const float* ref, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = ::hybridrl::kl_value<KIND, float>(lp[i], ref[i]);
}

template <int64_t KIND>
void kl_bwd_span(const float* grad, const float* lp, const float* ref, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = ::hybridrl::kl_grad<KIND, float>(grad[i], lp[i], ref[i]);
  }
}

// grad == nullptr: forward; else backward. One switch per span, outside the loop.
void kl_span(int64_t kind, const float* grad, const float* lp, const float* ref, float* out,
             int64_t n) {
  switch (kind) {
    case ::hybridrl::kK1:
      return grad ? kl_bwd_span<::hybridrl::kK1>(grad, lp, ref, out, n)
                  : kl_fwd_span<::hybridrl::kK1>(lp, ref, out, n);
    case ::hybridrl::kAbs:
      return grad ? kl_bwd_span<::hybridrl::kAbs>(grad, lp, ref, out, n)
                  : kl_fwd_span<::hybridrl::kAbs>(lp, ref, out, n);
    case ::hybridrl::kK2:
      return grad ? kl_bwd_span<::hybridrl::kK2>(grad, lp, ref, out, n)
                  : kl_fwd_span<::hybridrl::kK2>(lp, ref, out, n);
    case ::hybridrl::kK1 | ::hybridrl::kStraight:  // the "+" codes: forward only
      return kl_fwd_span<::hybridrl::kK1 | ::hybridrl::kStraight>(lp, ref, out, n);
    case ::hybridrl::kAbs | ::hybridrl::kStraight:
      return kl_fwd_span<::hybridrl::kAbs | ::hybridrl::kStraight>(lp, ref, out, n);
    case ::hybridrl::kK3 | ::hybridrl::kStraight:
      return kl_fwd_span<::hybridrl::kK3 | ::hybridrl::kStraight>(lp, ref, out, n);
    default:
      return grad ? kl_bwd_span<::hybridrl::kK3>(grad, lp, ref, out, n)
                  : kl_fwd_span<::hybridrl::kK3>(lp, ref, out, n);
  }
}
