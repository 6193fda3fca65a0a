"""The CUDA GAE kernel's exact algorithm (tests/unit/gae_cuda_emulation.py) on CPU.

- The launch plan: by T a row is one segment when it fits (no padding at T = 128 ... 2048 in
  fp32, at most half a segment of padding otherwise), several short rows share a block; the
  Python mirror equals csrc/cuda/gae_plan.h (compiled with the host C++ compiler).
- Shared memory: every load, chunk and store phase of every launch shape is one wavefront per
  warp (no bank conflicts), fp32 and fp64; the unskewed layout the kernel used before has 8-way
  conflicts (so the checker can fail).
- The emulated kernel equals the reference loop on the hard cases: T = 1, T = segment +- 1 for
  each launch shape, holes across warps and across segments, fractional masks, fully masked
  rows, rows past B in the last block, fp32 and fp64, fp16 output rounding, inf/NaN inputs.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrl.kernels import reference as ref
from tests.unit.gae_cuda_emulation import (
    emulate_gae_kernel,
    full_chunk,
    plan_gae,
    skew,
    wavefronts,
)

SHAPES = {4: [(32, 4), (32, 8), (64, 8), (128, 8), (256, 8), (256, 4)],
          8: [(32, 2), (32, 4), (64, 4), (128, 4), (256, 4), (256, 2)]}


@pytest.mark.parametrize("acc_bytes", [4, 8])
def test_plan_covers_short_rows_with_one_segment(acc_bytes):
    full = full_chunk(acc_bytes)
    segments = sorted(rt * ch for rt, ch in SHAPES[acc_bytes][:5])
    for T in [1, 2, 31, 64, 100, 127, 128, 129, 300, 511, 512, 513, 1000, 1024, 1500, 2048]:
        if T > 256 * full:
            continue
        rt, ch, _, _ = plan_gae(64, T, acc_bytes, sms=132)
        assert (rt, ch) in SHAPES[acc_bytes]
        assert rt * ch == min(s for s in segments if s >= T), T  # the tightest single segment
    # the issue's case: T = 512 in fp32 was 75% identity padding with 2048-step segments
    rt, ch, _, _ = plan_gae(4096, 512, 4, sms=132)
    assert rt * ch == 512


@pytest.mark.parametrize("acc_bytes", [4, 8])
def test_plan_long_rows_pick_the_chunk_with_least_padding(acc_bytes):
    full = full_chunk(acc_bytes)
    seg = 256 * full
    for T, chunk in [(seg + 1, full // 2), (2 * seg, full), (2 * seg + seg // 2, full // 2),
                     (3 * seg - 1, full), (4 * seg, full)]:
        rt, ch, rows, _ = plan_gae(1000, T, acc_bytes, sms=132)
        assert (rt, ch, rows) == (256, chunk, 1), T
        padded = -(-T // (rt * ch)) * rt * ch
        assert padded - T < rt * ch and padded - T <= T // 2


def test_plan_packs_short_rows_once_every_sm_has_two_blocks():
    assert plan_gae(4096, 100, 4, sms=132) == (32, 4, 8, 512)
    assert plan_gae(4096, 1000, 4, sms=132) == (128, 8, 2, 2048)
    assert plan_gae(300, 100, 4, sms=132) == (32, 4, 2, 150)
    assert plan_gae(100, 100, 4, sms=132) == (32, 4, 1, 100)  # few rows: one per block
    assert plan_gae(5, 100, 4, sms=1) == (32, 4, 3, 2)  # last block: one row slot past B
    assert plan_gae(4096, 8192, 4, sms=132) == (256, 8, 1, 4096)


@pytest.mark.parametrize("acc_bytes", [4, 8])
def test_shared_memory_phases_are_conflict_free(acc_bytes):
    for rt, chunk in SHAPES[acc_bytes]:
        for warp in range(rt // 32):
            lt = warp * 32 + np.arange(32)
            q = rt - 1 - lt
            for k in range(chunk):
                coalesced = skew(lt + k * rt, acc_bytes)  # load and store phases
                chunked = skew(q * chunk + k, acc_bytes)  # compose and recurrence phases
                minimum = 1 if acc_bytes == 4 else 2  # 8-byte words: two half-warps
                assert wavefronts(coalesced, acc_bytes) == minimum, (rt, chunk, warp, k)
                assert wavefronts(chunked, acc_bytes) == minimum, (rt, chunk, warp, k)
        seg = rt * chunk  # the skew maps a segment one-to-one into its row's words
        words = skew(np.arange(seg), acc_bytes)
        assert len(set(words.tolist())) == seg and words.max() < seg + seg * acc_bytes // 128


def test_unskewed_layout_has_the_bank_conflicts_the_issue_found():
    q = 255 - np.arange(32)
    assert wavefronts(q * 8, 4) == 8  # fp32, chunk 8: 8-way
    assert wavefronts(q * 4, 8) == 8  # fp64, chunk 4: 4-way per half-warp


def _inputs(B, T, seed, dtype):
    g = np.random.default_rng(seed)
    r = g.standard_normal((B, T)).astype(dtype)
    v = g.standard_normal((B, T)).astype(dtype)
    m = (g.random((B, T)) > 0.3).astype(dtype)
    return r, v, m


def _loop(r, v, m, gamma, lam):
    t = [torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in (r, v, m)]
    return [a.numpy() for a in ref.gae_ref(*t, gamma, lam)]


def _check(r, v, m, gamma, lam, sms=132, plan=None):
    adv, ret = emulate_gae_kernel(r, v, m, gamma, lam, sms=sms, plan=plan)
    want_adv, want_ret = _loop(r, v, m, gamma, lam)
    tol = 1e-12 if r.dtype == np.float64 else 2e-5
    scale = 1.0 + np.abs(want_adv).max()
    np.testing.assert_allclose(adv, want_adv, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(ret, want_ret, rtol=tol, atol=tol * scale)
    return adv, ret


def _boundary_lengths(acc_bytes):
    lengths = {1, 2}
    for rt, ch in SHAPES[acc_bytes]:
        lengths |= {rt * ch - 1, rt * ch, rt * ch + 1}
    return sorted(lengths)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_emulation_matches_loop_at_segment_boundaries(dtype):
    acc_bytes = np.dtype(dtype).itemsize
    for T in _boundary_lengths(acc_bytes):
        r, v, m = _inputs(3, T, seed=T, dtype=dtype)
        m[0] = 0  # fully masked row: advantages stay 0
        adv, _ = _check(r, v, m, 0.99, 0.95, sms=1)  # 3 rows: rows share blocks, one slot past B
        assert np.all(adv[0] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_emulation_matches_loop_with_holes_across_warps_and_segments(dtype, gamma, lam):
    acc_bytes = np.dtype(dtype).itemsize
    T = 3 * 256 * full_chunk(acc_bytes) + 77  # several segments of the longest shape
    r, v, m = _inputs(6, T, seed=7, dtype=dtype)
    seg = 256 * full_chunk(acc_bytes) // 2  # the plan picks half chunks here
    assert plan_gae(6, T, acc_bytes, 132)[:2] == (256, full_chunk(acc_bytes) // 2)
    m[1] = 1
    m[2, 200:700] = 0  # a hole across several warps of one segment
    m[3, T - seg - 300:T - seg + 300] = 0  # a hole across a segment boundary
    m[4, : T - 5] = 0  # only the last tokens valid
    m[5] = np.random.default_rng(1).random(T).astype(dtype)  # fractional mask
    _check(r, v, m, gamma, lam)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_emulation_matches_loop_on_every_launch_shape(dtype):
    acc_bytes = np.dtype(dtype).itemsize
    for rt, ch in SHAPES[acc_bytes]:
        for T in (rt * ch - 3, 2 * rt * ch + 5):  # one partial segment, three segments
            r, v, m = _inputs(5, T, seed=rt + ch + T, dtype=dtype)
            m[2] = np.random.default_rng(T).random(T).astype(dtype)
            _check(r, v, m, 0.97, 0.9, plan=(rt, ch, 2, 3))  # rows 5: a slot past B


def test_emulation_fp16_output_is_one_rounding_of_fp32_math():
    r, v, m = _inputs(4, 700, seed=3, dtype=np.float16)
    adv32, ret32 = emulate_gae_kernel(r.astype(np.float32), v.astype(np.float32),
                                      m.astype(np.float32), 0.99, 0.95)
    want_adv = ref.gae_ref(*(torch.from_numpy(a.astype(np.float32)) for a in (r, v, m)),
                           0.99, 0.95)[0].numpy()
    np.testing.assert_allclose(adv32.astype(np.float16).astype(np.float32),
                               want_adv.astype(np.float16).astype(np.float32),
                               rtol=2e-3, atol=2e-3)


def test_emulation_keeps_nan_and_inf_where_the_loop_has_them():
    r, v, m = _inputs(2, 300, seed=5, dtype=np.float64)
    v[0, 150] = np.inf
    r[1, 40] = np.nan
    with np.errstate(invalid="ignore"):
        adv, _ = emulate_gae_kernel(r, v, m, 0.99, 0.95)
        want, _ = _loop(r, v, m, 0.99, 0.95)
    np.testing.assert_array_equal(np.isnan(adv), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(adv), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(adv[finite], want[finite], rtol=1e-12, atol=1e-12)


_PLAN_DRIVER = r"""
#include <cstdio>
#include "gae_plan.h"
int main() {
  long long B, T; int acc, sms;
  while (std::scanf("%lld %lld %d %d", &B, &T, &acc, &sms) == 4) {
    const hybridrl::GaePlan p = hybridrl::plan_gae(B, T, acc, sms);
    std::printf("%d %d %d %lld\n", p.row_threads, p.chunk, p.rows_per_block, (long long)p.blocks);
  }
}
"""


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build gae_plan.h")
def test_plan_mirror_equals_gae_plan_h(tmp_path):
    """The Python plan the emulation uses is the C++ one the kernel launches (csrc/cuda)."""
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "driver.cpp").write_text(_PLAN_DRIVER)
    exe = tmp_path / "plan"
    subprocess.run(["c++", "-std=c++17", "-O1", f"-I{root / 'csrc' / 'cuda'}",
                    str(tmp_path / "driver.cpp"), "-o", str(exe)], check=True, timeout=120)
    cases = [(B, T, acc, sms) for B in (1, 3, 264, 265, 4096) for acc in (4, 8)
             for sms in (1, 132) for T in list(range(1, 70, 7)) + [127, 128, 129, 255, 257,
                                                                 511, 513, 1023, 1025, 2047,
                                                                 2048, 2049, 3000, 3073,
                                                                 5000, 8192, 20000]]
    out = subprocess.run([str(exe)], input="\n".join(" ".join(map(str, c)) for c in cases),
                         capture_output=True, text=True, check=True, timeout=60).stdout
    got = [tuple(int(x) for x in line.split()) for line in out.splitlines()]
    assert got == [plan_gae(*c) for c in cases]
