// Tiled CPU GAE loop, SIMD across rows. Included once per CPU ISA (see gae_cpu.cpp) inside a
// namespace under `#pragma GCC target`; no include guard on purpose.
//
// A tile is kLanes rows x kSteps time steps: it is transposed into step-major buffers
// ([step][lane], rows contiguous), the recurrence runs backwards over steps with all kLanes rows
// in one vector (the lane loop vectorizes), and the results are transposed back. Walking rows
// one at a time instead is latency-bound (a serial chain of ~12 cycles per step), and walking
// several rows at once with row-major accesses thrashes L1 when T * 4 bytes is a multiple of 4 KiB.

constexpr int64_t kLanes = 8;
constexpr int64_t kSteps = 64;

// Rows [0, kLanes) starting at the given pointers (row stride T); fp32 math (double for fp64).
template <typename scalar_t, typename acc_t>
void gae_tile_rows(const scalar_t* rew, const scalar_t* val, const scalar_t* msk, scalar_t* adv,
                   scalar_t* ret, int64_t T, acc_t gamma, acc_t gl) {
  alignas(64) acc_t r_buf[kSteps][kLanes], v_buf[kSteps][kLanes], m_buf[kSteps][kLanes];
  alignas(64) acc_t nextv[kLanes], last[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) nextv[k] = last[k] = acc_t(0);
  for (int64_t t1 = T; t1 > 0; t1 -= kSteps) {
    const int64_t t0 = t1 > kSteps ? t1 - kSteps : 0, len = t1 - t0;
    for (int64_t j = 0; j < len; ++j) {
      for (int64_t k = 0; k < kLanes; ++k) {
        r_buf[j][k] = static_cast<acc_t>(rew[k * T + t0 + j]);
        v_buf[j][k] = static_cast<acc_t>(val[k * T + t0 + j]);
        m_buf[j][k] = static_cast<acc_t>(msk[k * T + t0 + j]);
      }
    }
    for (int64_t j = len - 1; j >= 0; --j) {
      for (int64_t k = 0; k < kLanes; ++k) {
        const acc_t v = v_buf[j][k];
        const acc_t a = ::hybridrl::gae_step<acc_t>(r_buf[j][k], v, m_buf[j][k], gamma, gl,
                                                    nextv[k], last[k]);
        r_buf[j][k] = a;      // advantages
        v_buf[j][k] = a + v;  // returns
      }
    }
    for (int64_t k = 0; k < kLanes; ++k) {
      for (int64_t j = 0; j < len; ++j) {
        adv[k * T + t0 + j] = static_cast<scalar_t>(r_buf[j][k]);
        ret[k * T + t0 + j] = static_cast<scalar_t>(v_buf[j][k]);
      }
    }
  }
}
