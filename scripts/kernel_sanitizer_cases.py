"""Small runs of every CUDA kernel for compute-sanitizer (scripts/gpu_check.sh step 3).

Contract: launches each CUDA kernel of hybridrl._C_cuda at least once with small inputs that
still reach every code path: all six GAE launch shapes per math dtype (T at and past a segment,
a last block with row slots past B, half chunks), fp16/bf16 GAE, every KL forward code and
backward kind with vector tails and misaligned storage, double backward, whitening (including
a mask summing to 0). Results are checked against the references, so a run is also a test.
Prints one line per group; exit status 1 on a mismatch, 2 when the CUDA ops are missing. Sizes
are kept small because memcheck and racecheck slow kernels by 10-100x.

    compute-sanitizer --tool racecheck --error-exitcode 9 python scripts/kernel_sanitizer_cases.py
"""

from __future__ import annotations

import sys

import torch

import hybridrl.kernels as K
from hybridrl.kernels import ops
from hybridrl.kernels import reference as ref


def _close(got, want, tol):
    torch.testing.assert_close(got.cpu().double(), want.cpu().double(), rtol=tol, atol=tol * 10,
                               equal_nan=True)


def gae_cases() -> None:
    # fp32 segments: 128 (32x4), 256 (32x8), 512 (64x8), 1024 (128x8), 2048 (256x8), 1024 (256x4,
    # long rows); fp64 halves them. B = 3 gives blocks of one row; 301 rows of T <= 512 share
    # blocks (2 per block on 132 SMs), the last block with a slot past B.
    for dtype, lengths in ((torch.float32, (1, 129, 256, 500, 1025, 2049, 4096)),
                           (torch.float64, (64, 128, 256, 513, 1000, 1025)),
                           (torch.float16, (300,)), (torch.bfloat16, (2049,))):
        for T in lengths:
            for B in (3, 301):  # 301 short rows: several rows per block
                if B * T > 160_000:
                    continue
                g = torch.Generator().manual_seed(T)
                r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
                m = torch.rand(B, T, generator=g)
                m[1:, T // 3:] = (m[1:, T // 3:] > 0.3).float()  # fractional, then holes
                got = K.gae(*(t.to("cuda", dtype) for t in (r, v, m)), 0.99, 0.95)
                want = ref.gae_ref(*(t.to(dtype).double() for t in (r, v, m)), 0.99, 0.95)
                tol = {torch.float64: 1e-10, torch.float32: 2e-5}.get(dtype, 2e-2)
                _close(got[0], want[0], tol)
                _close(got[1], want[1], tol)
    print("gae: ok")


def kl_cases() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        base = torch.randn(2, 1003, dtype=torch.float64) * 3
        lp, rl = base[0, 1:].to("cuda", dtype), base[1, :1002].to("cuda", dtype)  # 1002: tails
        for misaligned in (False, True):
            a_lp = lp.new_empty(1003)[1:].copy_(lp) if misaligned else lp
            for kind in ("abs", "k2", "k3", "k1+", "abs+", "k3+"):
                x = a_lp.detach().clone().requires_grad_()
                out = K.kl_penalty(x, rl, kind)
                out.backward(torch.ones_like(out))
                y = a_lp.detach().double().clone().requires_grad_()
                want = ref.kl_penalty_ref(y, rl.double(), kind)
                want.backward(torch.ones_like(want))
                tol = 1e-12 if dtype == torch.float64 else 1e-2
                _close(out, want, tol)
                _close(x.grad, y.grad, tol)
    lp = torch.randn(500, device="cuda", dtype=torch.float64, requires_grad=True)
    rl = torch.randn(500, device="cuda", dtype=torch.float64)
    (g1,) = torch.autograd.grad(K.kl_penalty(lp, rl, "k3").sum(), lp, create_graph=True)
    (g2,) = torch.autograd.grad(g1.sum(), lp)
    lp2 = lp.detach().clone().requires_grad_()
    (w1,) = torch.autograd.grad(ref.kl_penalty_ref(lp2, rl, "k3").sum(), lp2, create_graph=True)
    (w2,) = torch.autograd.grad(w1.sum(), lp2)
    _close(g2, w2, 1e-12)
    print("kl: ok")


def whiten_cases() -> None:
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = torch.randn(37, 301, dtype=torch.float64) * 4 + 1
        m = (torch.rand(37, 301) > 0.4).double()
        got = K.masked_whiten(x.to("cuda", dtype), m.to("cuda", dtype))
        want = ref.masked_whiten_ref(x.to(dtype).double(), m)
        _close(got, want, {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2))
    try:
        K.masked_whiten(torch.randn(4, 4, device="cuda"), torch.zeros(4, 4, device="cuda"))
    except ValueError:
        pass
    else:
        raise AssertionError("masked_whiten: a mask summing to 0 must raise ValueError")
    print("whiten: ok")


def main() -> int:
    if not torch.cuda.is_available() or not all(ops.compiled_available(op, "cuda")
                                                for op in ops.OP_NAMES):
        print("hybridrl CUDA ops are not available (build hybridrl._C_cuda first)")
        return 2
    try:
        gae_cases()
        kl_cases()
        whiten_cases()
    except AssertionError as err:
        print(f"MISMATCH: {err}")
        return 1
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
