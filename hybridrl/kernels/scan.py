"""The chunk/segment scan behind csrc/cuda/gae_cuda.cu, in torch, for any threads x chunk.

Contract: ``gae_chunked_scan(rewards, values, mask, gamma, lam, threads, chunk)`` returns
(advantages [B, T], returns [B, T]) equal to ``reference.gae_ref`` up to rounding, by the
segment/chunk decomposition the CUDA kernel uses (with one Hillis-Steele scan over all threads;
the kernel's exact schedule, launch plan and warp scans are emulated step for step in
tests/unit/gae_cuda_emulation.py):

- Walking t backwards the state s = (x = nextv, y = last) follows an affine map per step,
  ``x' = a x + b``, ``y' = c x + d y + e`` with (a, b, c, d, e) =
  ``(1 - m, m v, m gamma, m gamma lam + 1 - m, m (r - v))``; maps compose associatively
  (``compose``), and a masked step (m = 0) is the identity.
- The row is cut from the end into segments of ``threads * chunk`` steps (left-padded with
  identity steps); per segment each "thread" composes its chunk, an exclusive Hillis-Steele scan
  over threads (thread 0 = latest chunk) gives each thread's incoming state from the carry, each
  thread re-runs the exact recurrence over its chunk, and the carry moves by the segment total.
"""

from __future__ import annotations

import torch

# Map tensors are [..., 5] = (a, b, c, d, e): (x, y) -> (a x + b, c x + d y + e).


def identity_maps(shape, dtype) -> torch.Tensor:
    maps = torch.zeros(*shape, 5, dtype=dtype)
    maps[..., 0] = 1
    maps[..., 3] = 1
    return maps


def compose(f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """f o g (apply g first) for map tensors [..., 5]."""
    fa, fb, fc, fd, fe = f.unbind(-1)
    ga, gb, gc, gd, ge = g.unbind(-1)
    return torch.stack([fa * ga, fa * gb + fb, fc * ga + fd * gc, fd * gd,
                        fc * gb + fd * ge + fe], dim=-1)


def step_maps(r, v, m, gamma: float, lam: float) -> torch.Tensor:
    """Per-step maps [..., 5] of rewards/values/mask [...]."""
    keep = 1 - m
    return torch.stack([keep, m * v, m * gamma, m * (gamma * lam) + keep, m * (r - v)], dim=-1)


def apply(f: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b, c, d, e = f.unbind(-1)
    return a * x + b, c * x + d * y + e


def _exclusive_scan(maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exclusive prefix, total) over dim -2 (threads) with prefix_j = M_{j-1} o ... o M_0."""
    n = maps.shape[-2]
    incl = maps
    offset = 1
    while offset < n:  # Hillis-Steele: log2(n) rounds
        earlier = torch.cat([identity_maps(incl.shape[:-2] + (offset,), incl.dtype),
                             incl[..., :-offset, :]], dim=-2)
        incl = compose(incl, earlier)
        offset *= 2
    excl = torch.cat([identity_maps(incl.shape[:-2] + (1,), incl.dtype), incl[..., :-1, :]], dim=-2)
    return excl, incl[..., -1, :]


@torch.no_grad()
def gae_chunked_scan(rewards, values, mask, gamma: float, lam: float, threads: int = 256,
                     chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], returns [B, T]) by the CUDA kernel's segment/chunk/scan schedule."""
    if threads < 1 or chunk < 1:
        raise ValueError(f"threads and chunk must be >= 1, got {threads}, {chunk}")
    B, T = values.shape
    seg = threads * chunk
    pad = (-T) % seg
    r, v, m = (torch.nn.functional.pad(t.to(values.dtype), (pad, 0)) for t in (rewards, values, mask))
    nseg = (T + pad) // seg
    adv = torch.empty_like(v)
    x = torch.zeros(B, dtype=v.dtype)
    y = torch.zeros(B, dtype=v.dtype)
    for s in reversed(range(nseg)):
        # [B, threads, chunk] with thread 0 owning the latest chunk of the segment.
        sl = slice(s * seg, (s + 1) * seg)
        rs, vs, ms = (t[:, sl].reshape(B, threads, chunk).flip(1) for t in (r, v, m))
        maps = step_maps(rs, vs, ms, gamma, lam)  # [B, threads, chunk, 5]
        chunk_map = identity_maps((B, threads), v.dtype)
        for k in reversed(range(chunk)):
            chunk_map = compose(maps[:, :, k], chunk_map)
        excl, total = _exclusive_scan(chunk_map)
        xs, ys = apply(excl, x[:, None], y[:, None])  # incoming state per thread [B, threads]
        out = torch.empty_like(vs)
        for k in reversed(range(chunk)):  # the exact recurrence (common.h gae_step)
            delta = (rs[:, :, k] + gamma * xs) - vs[:, :, k]
            g = delta + (gamma * lam) * ys
            keep = 1 - ms[:, :, k]
            xs = vs[:, :, k] * ms[:, :, k] + keep * xs
            ys = g * ms[:, :, k] + keep * ys
            out[:, :, k] = ys
        adv[:, sl] = out.flip(1).reshape(B, seg)
        x, y = apply(total, x, y)
    adv = adv[:, pad:]
    return adv, adv + values
