// Run-time choice of a CPU kernel's SIMD path, shared by the KL, SwiGLU/RoPE and RMSNorm kernels.
//
// Contract:
// - cpu_simd_levels(): whether this CPU runs the AVX2 path (AVX2 with FMA and F16C) and the
//   AVX-512 path (that plus AVX-512F); both false off x86, where only the baseline path exists.
// - isa_env(): the value of HYBRIDRL_CPU_ISA, "" when unset.
// - pick_isa_path(paths, want, source, kernel): `paths` are the paths this CPU can run, best
//   first, baseline last, each with a `name`; returns the best for "" or "auto", the path named
//   `want` otherwise, or raises ValueError "<source><want> is not <kernel> kernel path this CPU
//   can run; choose one of auto, <names>" (kernel: "a KL", "an RMSNorm", ...).
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace hybridrl {
namespace isa_select {

struct SimdLevels {
  bool avx2 = false;
  bool avx512 = false;
};

inline SimdLevels cpu_simd_levels() {
  SimdLevels levels;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  levels.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                __builtin_cpu_supports("f16c");
  levels.avx512 = levels.avx2 && __builtin_cpu_supports("avx512f");
#endif
  return levels;
}

inline std::string isa_env() {
  const char* env = std::getenv("HYBRIDRL_CPU_ISA");
  return env ? env : "";
}

template <typename Path>
Path pick_isa_path(const std::vector<Path>& paths, const std::string& want, const char* source,
                   const char* kernel) {
  if (want.empty() || want == "auto") return paths.front();
  std::string names = "auto";
  for (const Path& p : paths) {
    if (want == p.name) return p;
    names += std::string(", ") + p.name;
  }
  TORCH_CHECK_VALUE(false, source, want, " is not ", kernel, " kernel path this CPU can run; "
                    "choose one of ", names);
}

}  // namespace isa_select
}  // namespace hybridrl
