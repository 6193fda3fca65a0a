// Launch plan of the CUDA GAE scan (csrc/cuda/gae_cuda.cu), a pure host function of the shape.
// Plain C++ (no CUDA headers): module.cpp exposes it to Python as hybridrl._C_cuda.gae_plan so
// the tests can check it against their emulation (tests/unit/gae_cuda_emulation.py).
//
// Contract of plan_gae(B, T, acc_bytes, sms):
// - full = 8 steps per thread for fp32 math, 4 for fp64 (acc_bytes = 8); half = full / 2.
// - T <= 256 * full: the smallest segment row_threads * chunk >= T among
//   (32, half), (32, full), (64, full), (128, full), (256, full), so a row is one segment and
//   at most half of it is identity padding (none at T = 128, 256, ..., 2048 for fp32).
// - longer rows: 256 threads per row and the chunk (full or half) whose whole segments cover T
//   with the fewest steps (ties: full, which has half the scans per step).
// - rows_per_block = min(256 / row_threads, ceil(B / (2 * sms))), at least 1: short rows share
//   a block (full occupancy despite the 32-blocks-per-SM limit) once there are enough rows to
//   give every SM two blocks; blocks = ceil(B / rows_per_block).
#pragma once

#include <algorithm>
#include <cstdint>

namespace hybridrl {

constexpr int kGaeMaxThreads = 256;  // threads of the largest block (and of one long row)

struct GaePlan {
  int row_threads;     // threads cooperating on one row: 32, 64, 128 or 256
  int chunk;           // steps each thread owns per segment
  int rows_per_block;  // rows sharing one block (blockDim.x = rows_per_block * row_threads)
  int64_t blocks;      // gridDim.x
};

inline int gae_full_chunk(int acc_bytes) { return acc_bytes == 8 ? 4 : 8; }

inline GaePlan plan_gae(int64_t B, int64_t T, int acc_bytes, int sms) {
  const int full = gae_full_chunk(acc_bytes), half = full / 2;
  GaePlan plan{kGaeMaxThreads, full, 1, 0};
  if (T <= int64_t(kGaeMaxThreads) * full) {
    const int shapes[5][2] = {{32, half}, {32, full}, {64, full}, {128, full}, {256, full}};
    for (const auto& shape : shapes) {
      if (int64_t(shape[0]) * shape[1] >= T) {
        plan.row_threads = shape[0];
        plan.chunk = shape[1];
        break;
      }
    }
  } else {
    const int64_t seg_full = int64_t(kGaeMaxThreads) * full, seg_half = seg_full / 2;
    const int64_t steps_full = (T + seg_full - 1) / seg_full * seg_full;
    const int64_t steps_half = (T + seg_half - 1) / seg_half * seg_half;
    plan.chunk = steps_half < steps_full ? half : full;
  }
  const int64_t max_rows = kGaeMaxThreads / plan.row_threads;
  const int64_t wanted = (B + 2 * int64_t(sms) - 1) / std::max<int64_t>(1, 2 * int64_t(sms));
  plan.rows_per_block = static_cast<int>(std::clamp<int64_t>(wanted, 1, max_rows));
  plan.blocks = (B + plan.rows_per_block - 1) / plan.rows_per_block;
  return plan;
}

}  // namespace hybridrl
