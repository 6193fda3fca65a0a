"""NumPy emulation of the CUDA GAE kernel (csrc/cuda/gae_cuda.cu), step for step.

Contract: ``emulate_gae_kernel(rewards, values, mask, gamma, lam, sms)`` runs the algorithm the
GPU runs (launch plan of csrc/cuda/gae_plan.h, segments from the end, identity padding of the
first segment and of the rows past B, per-thread chunk composition, warp scans with
``__shfl_up_sync`` semantics, the cross-warp combine of each row, the segment carry) on NumPy
arrays in the kernel's math dtype, one IEEE operation per kernel operation in the kernel's
order. The kernel is built with ``--fmad=false``, so in fp32 and fp64 this reproduces its bits;
tests/gpu/test_kernels_cuda.py asserts that on a GPU, tests/unit/test_gae_cuda_emulation.py
checks the emulation against the reference loop on CPU.

Also here: ``plan_gae`` (the launch plan, mirrored from gae_plan.h), ``skew`` (the shared-memory
word of a segment element) and ``wavefronts`` (shared-memory bank-conflict count of one warp
access), used to check that every shared-memory phase of every launch shape is conflict-free.
Emulated shared memory starts as NaN, so a read of a word the kernel never wrote shows up.
"""

from __future__ import annotations

import numpy as np

MAX_THREADS = 256  # kGaeMaxThreads


def full_chunk(acc_bytes: int) -> int:
    return 4 if acc_bytes == 8 else 8


def plan_gae(B: int, T: int, acc_bytes: int, sms: int) -> tuple[int, int, int, int]:
    """(row_threads, chunk, rows_per_block, blocks): csrc/cuda/gae_plan.h ``plan_gae``."""
    full = full_chunk(acc_bytes)
    half = full // 2
    row_threads, chunk = MAX_THREADS, full
    if T <= MAX_THREADS * full:
        for rt, ch in ((32, half), (32, full), (64, full), (128, full), (256, full)):
            if rt * ch >= T:
                row_threads, chunk = rt, ch
                break
    else:
        seg_full = MAX_THREADS * full
        seg_half = seg_full // 2
        steps_full = -(-T // seg_full) * seg_full
        steps_half = -(-T // seg_half) * seg_half
        chunk = half if steps_half < steps_full else full
    max_rows = MAX_THREADS // row_threads
    wanted = -(-B // max(1, 2 * sms))
    rows = min(max(wanted, 1), max_rows)
    return row_threads, chunk, rows, -(-B // rows)


def skew(i, acc_bytes: int):
    """Shared-memory word of segment element i: one padding word after every 128 bytes."""
    return i + i // (128 // acc_bytes)


def wavefronts(words, acc_bytes: int) -> int:
    """Shared-memory wavefronts of one warp access to ``words`` [32] (element-sized words).

    Banks are 4 bytes wide, 32 of them; lanes reading the same word share it (broadcast). 8-byte
    accesses are served per half-warp: the count is the sum over the two halves.
    """
    words = np.asarray(words)

    def worst(ws):
        per_bank: dict[int, set] = {}
        for w in ws.tolist():
            for k in range(acc_bytes // 4):
                per_bank.setdefault((w * (acc_bytes // 4) + k) % 32, set()).add(w)
        return max(len(s) for s in per_bank.values())

    if acc_bytes == 4:
        return worst(words)
    return worst(words[:16]) + worst(words[16:])


# Affine maps (x, y) -> (a x + b, c x + d y + e) as tuples of arrays.


def _identity_like(x):
    one, zero = np.ones_like(x), np.zeros_like(x)
    return one, zero, zero.copy(), one.copy(), zero.copy()


def _compose(f, g):
    """f o g (apply g, then f), in the kernel's operation order."""
    fa, fb, fc, fd, fe = f
    ga, gb, gc, gd, ge = g
    return (fa * ga, fa * gb + fb, fc * ga + fd * gc, fd * gd, fc * gb + fd * ge + fe)


def _step_map(r, v, m, gamma, gl):
    keep = m.dtype.type(1) - m
    return (keep, m * v, m * gamma, m * gl + keep, m * (r - v))


def _where(cond, f, g):
    return tuple(np.where(cond, a, b) for a, b in zip(f, g))


def _shfl_up(f, offset: int):
    """__shfl_up_sync over the last axis (32 lanes): lanes < offset keep their own value."""
    return tuple(np.concatenate([a[..., :offset], a[..., :-offset]], axis=-1) for a in f)


def _warp_scan(f):
    """Inclusive scan over the last axis (lanes): lane l gets M_l o ... o M_0."""
    lane = np.arange(32)
    offset = 1
    while offset < 32:
        f = _where(lane >= offset, _compose(f, _shfl_up(f, offset)), f)
        offset *= 2
    return f


def _row_exclusive_scan(f, row_warps: int):
    """(exclusive prefix, total) over the row's threads; f arrays [..., row_warps, 32]."""
    lane = np.arange(32)
    incl = _warp_scan(f)
    excl = _where(lane == 0, _identity_like(incl[0]), _shfl_up(incl, 1))
    if row_warps == 1:
        total = tuple(np.broadcast_to(a[..., 31:32], a.shape) for a in incl)
        return excl, total
    warp_tot = tuple(a[..., :, 31] for a in incl)  # [..., row_warps], written by lane 31
    # the row's first warp: lane l < row_warps reads warp_tot[l], the others the identity
    pad = 32 - row_warps
    lanes = tuple(np.concatenate([a, np.broadcast_to(idn[..., :1], a.shape[:-1] + (pad,))],
                                 axis=-1)
                  for a, idn in zip(warp_tot, _identity_like(incl[0][..., 0, :])))
    scanned = tuple(a[..., :row_warps] for a in _warp_scan(lanes))  # written back by lane < RW
    earlier = tuple(np.concatenate([np.zeros_like(a[..., :1]), a[..., :-1]], axis=-1)[..., None]
                    for a in scanned)  # warp_tot[warp - 1], broadcast over lanes
    warp = np.arange(row_warps)[:, None]
    excl = _where(warp > 0, _compose(excl, earlier), excl)
    total = tuple(np.broadcast_to(a[..., row_warps - 1:row_warps, None], excl[0].shape)
                  for a in scanned)
    return excl, total


def emulate_gae_kernel(rewards, values, mask, gamma: float, lam: float, sms: int = 132,
                       plan=None):
    """(advantages, returns) [B, T] as the CUDA kernel computes them, in the inputs' dtype.

    rewards, values, mask: [B, T] NumPy arrays of the kernel's math dtype (float32 for
    fp32/bf16/fp16 inputs converted exactly, float64 for fp64). plan: override of
    ``plan_gae(B, T, acc_bytes, sms)``.
    """
    acc = values.dtype.type
    acc_bytes = values.dtype.itemsize
    B, T = values.shape
    row_threads, chunk, rows, blocks = plan or plan_gae(B, T, acc_bytes, sms)
    seg, row_warps = row_threads * chunk, row_threads // 32
    row_words = seg + seg * acc_bytes // 128
    g_, gl = acc(gamma), acc(gamma * lam)
    adv = np.full((B, T), np.nan, dtype=acc)
    ret = np.full((B, T), np.nan, dtype=acc)
    # threads as [blocks, rows, row_warps, 32]; lt = thread within its row
    lt = np.arange(row_threads).reshape(row_warps, 32)
    q = row_threads - 1 - lt
    row = (np.arange(blocks)[:, None] * rows + np.arange(rows)[None, :])[:, :, None, None]
    live = row < B
    shape = (blocks, rows, row_warps, 32)
    shared = {k: np.full((blocks, rows, row_words), np.nan, dtype=acc) for k in "rvm"}
    bidx = np.arange(blocks)[:, None, None, None]
    sidx = np.arange(rows)[None, :, None, None]
    cx = np.zeros(shape, dtype=acc)
    cy = np.zeros(shape, dtype=acc)
    for seg_end in range(T, 0, -seg):
        t0 = seg_end - seg
        for k in range(chunk):  # (1) coalesced load
            i = lt + k * row_threads
            t = t0 + i
            ok = live & (t >= 0)
            rr, tt = np.where(ok, row, 0), np.where(ok, t, 0)
            for key, src in (("r", rewards), ("v", values), ("m", mask)):
                shared[key][bidx, sidx, skew(i, acc_bytes)] = np.where(ok, src[rr, tt], acc(0))
        words = [skew(q * chunk + k, acc_bytes) for k in range(chunk)]
        r_, v_, m_ = ({k: shared[key][bidx, sidx, w] for k, w in enumerate(words)}
                      for key in "rvm")
        f = _identity_like(cx)  # (2) chunk maps
        for k in reversed(range(chunk)):
            f = _compose(_step_map(r_[k], v_[k], m_[k], g_, gl), f)
        later, total = _row_exclusive_scan(f, row_warps)  # (3)
        x = later[0] * cx + later[1]
        y = later[2] * cx + later[3] * cy + later[4]
        for k in reversed(range(chunk)):  # (4) the exact recurrence, common.h gae_step
            r, v, m = r_[k], v_[k], m_[k]
            delta = (r + g_ * x) - v
            gg = delta + gl * y
            keep = acc(1) - m
            x = v * m + keep * x
            y = gg * m + keep * y
            shared["r"][bidx, sidx, words[k]] = y
            shared["v"][bidx, sidx, words[k]] = y + v
        next_y = total[2] * cx + total[3] * cy + total[4]  # (5) carry
        cx = total[0] * cx + total[1]
        cy = next_y
        for k in range(chunk):  # coalesced store
            i = lt + k * row_threads
            t = t0 + i
            ok = np.broadcast_to(live & (t >= 0), shape)
            w = np.broadcast_to(skew(i, acc_bytes), shape)
            rows_ok = np.broadcast_to(row, shape)[ok]
            ts = np.broadcast_to(t, shape)[ok]
            b_ok, s_ok = np.broadcast_to(bidx, shape)[ok], np.broadcast_to(sidx, shape)[ok]
            adv[rows_ok, ts] = shared["r"][b_ok, s_ok, w[ok]]
            ret[rows_ok, ts] = shared["v"][b_ok, s_ok, w[ok]]
    return adv, ret
