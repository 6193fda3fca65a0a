// bf16 / fp16 <-> fp32 row conversion for the CPU kernels' 16-bit paths (KL, SwiGLU/RoPE).
//
// Textually included INSIDE each ISA namespace (kl_spans.h, swiglu_spans.h), after that
// namespace defines `kHalfLanes`, `widen_half` and `narrow_half` under its `#pragma GCC target`,
// so every path compiles its own copy; no include guard on purpose.
// Contract: widen(src, dst, n) writes n fp32 values exactly (bf16: the bits shifted; fp16:
// F16C/AVX-512 lanes where the path has them, else c10's conversion); narrow(src, dst, n)
// rounds to nearest even, NaN -> the dtype's quiet NaN (bf16 0x7FC0), as c10's constructors do.

inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(src[i].x) << 16);
  }
}

// The NaN test is on the bits (no float compare), so the select vectorizes.
inline void narrow(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = __builtin_bit_cast(uint32_t, src[i]);
    const uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
    dst[i].x = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  }
}

inline void widen(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kHalfLanes <= n; i += kHalfLanes) widen_half(src + i, dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void narrow(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kHalfLanes <= n; i += kHalfLanes) narrow_half(src + i, dst + i);
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}
