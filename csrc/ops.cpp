// Schemas of the hybridrl custom ops and the Python module stub of hybridrl._C.
// Importing hybridrl._C runs the static TORCH_LIBRARY registrations below and in csrc/cpu/*.cpp;
// the CUDA kernels live in the separate module hybridrl._C_cuda. Fake kernels and the autograd
// formula are registered from Python (hybridrl/kernels/ops.py).
#include <Python.h>
#include <torch/library.h>

#include <string>

namespace hybridrl {
std::string kl_cpu_isa();  // csrc/cpu/kl_cpu.cpp
}  // namespace hybridrl

TORCH_LIBRARY(hybridrl, m) {
  // Per-token KL estimate of code fwd_kind (0 k1, 1 abs, 2 k2, 3 k3); bwd_kind is the estimator
  // whose gradient autograd uses (k2 for the straight-through "+" kinds).
  m.def("kl_forward(Tensor logprob, Tensor ref_logprob, int fwd_kind, int bwd_kind) -> Tensor");
  // grad * d(estimator bwd_kind)/d(logprob); the ref_logprob gradient is its negation.
  m.def("kl_backward(Tensor grad, Tensor logprob, Tensor ref_logprob, int bwd_kind) -> Tensor");
  // Masked GAE over [B, T]: (advantages, returns), no whitening.
  m.def(
      "gae(Tensor rewards, Tensor values, Tensor mask, float gamma, float lam)"
      " -> (Tensor, Tensor)");
  // (values - mean) * rsqrt(unbiased var + 1e-8), statistics over mask != 0 of the whole tensor.
  m.def("masked_whiten(Tensor values, Tensor mask) -> Tensor");
  // Name of the SIMD path of the CPU KL kernels: "avx512", "avx2" or "baseline" (SSE2 / NEON);
  // HYBRIDRL_CPU_ISA, read once at the first KL call, forces one.
  m.def("kl_cpu_isa() -> str", &hybridrl::kl_cpu_isa);
}

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
