"""Small runs of every CUDA kernel launch path, for compute-sanitizer (gpu_check stage sanitize).

Contract: launches every template instance of hybridrl._C_cuda with small inputs and checks each
result against the pure-torch reference (so a run is also a test):
- GAE: each of the six launch shapes of csrc/cuda/gae_plan.h, (row threads, steps per thread) =
  (32, half), (32, full), (64, full), (128, full), (256, full), (256, half) with full = 8 for
  fp32 math and 4 for fp64, for each of the four dtypes (fp32, fp64, fp16, bf16: 24 kernels);
  rows sharing a block (2, 4 and 8 per block) with a last block whose row slots run past B; T at
  segment boundaries, past them, and over several segments. ``gae_launch_cases(sms)`` derives the
  cases from the plan's rules; ``coverage_problems`` checks them against a plan function (the
  extension's own ``_C_cuda.gae_plan`` here, the NumPy emulation's in tests/unit) and a gap
  fails the run before any kernel runs.
- KL: every forward code (k1, abs, k2, k3 and the straight-through k1+, abs+, k3+) and backward
  kind, called as the ops themselves (k1 too, which ``kl_penalty`` computes eagerly), per dtype,
  on 16-byte-aligned storage and on contiguous views that are not (logprob, ref and grad one
  element into their storage: the kernel's copy-first path, asserted), odd tails for every vector
  width, a grad of another dtype, a grid-stride loop of several passes, double backward.
- Whitening: the four dtypes, more partial sums than one folding block's threads, a normalize
  grid-stride loop of several passes, and the mask-sums-to-0/1 errors.
Prints one line per group; exit status 1 on a mismatch or a coverage gap (a ``MISMATCH`` or
``COVERAGE`` line), 2 when the ops are missing. ``--only gae,whiten`` runs some groups (racecheck
and synccheck skip kl: its kernel has no shared memory and no barrier). ``--device cpu`` runs the
same cases on the CPU kernels (hybridrl._C), so the case code itself is tested without a GPU.
Sizes stay small (memcheck and racecheck slow kernels 10-100x):

    compute-sanitizer --tool racecheck --error-exitcode 9 python scripts/kernel_sanitizer_cases.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
KL_KINDS = ("k1", "abs", "k2", "k3", "k1+", "abs+", "k3+")
MAX_THREADS = 256  # kGaeMaxThreads


@dataclasses.dataclass(frozen=True)
class GaeCase:
    dtype: str
    B: int
    T: int
    shape: tuple[int, int]  # (row threads, steps per thread) the plan must choose
    rows_per_block: int  # the plan's rows per block (1: one row per block)


def acc_bytes(dtype: str) -> int:
    return 8 if dtype == "float64" else 4


def gae_launch_cases(sms: int) -> list[GaeCase]:
    """Cases that reach every launch shape of gae_plan.h on a device of ``sms`` multiprocessors."""
    cases = []
    for dtype in DTYPES:
        full = 4 if acc_bytes(dtype) == 8 else 8
        half = full // 2
        sharing = 2 * sms  # B > k * 2 * sms rows: k + 1 rows per block (up to 256 / row threads)
        few = min(3, sharing)  # rows that still get a block each
        rows = [  # (B, T, expected shape, expected rows per block)
            (few, 1, (32, half), 1),  # one step: the rest of the segment is padding
            (few, 32 * half, (32, half), 1),  # a full segment
            (8 * sharing - 1, 5, (32, half), 8),  # 8 rows per block, the last block short
            (few, 32 * half + 1, (32, full), 1),
            (2 * sharing - 1, 32 * full, (32, full), 2),
            (few, 64 * full - 3, (64, full), 1),
            (4 * sharing - 1, 32 * full + 1, (64, full), 4),
            (few, 128 * full, (128, full), 1),  # the 128-thread rows
            (2 * sharing - 1, 64 * full + 1, (128, full), 2),
            (few, 128 * full + 1, (256, full), 1),
            (5, MAX_THREADS * full, (256, full), 1),
            (few, MAX_THREADS * full + 1, (256, half), 1),  # long: 3 half segments beat 2 full
            (2, 2 * MAX_THREADS * full, (256, full), 1),  # long rows: 2 full segments
        ]
        cases += [GaeCase(dtype, B, T, shape, per_block) for B, T, shape, per_block in rows]
    return cases


def coverage_problems(cases: list[GaeCase], plan_fn, sms: int) -> list[str]:
    """What ``cases`` miss: a case whose plan differs from its expectation, a launch shape of
    gae_plan.h never reached for a dtype, or no last block running past B with shared blocks.
    ``plan_fn(B, T, acc_bytes, sms) -> (row_threads, chunk, rows_per_block, blocks)``."""
    problems, reached = [], {}
    for c in cases:
        rt, chunk, rows, blocks = plan_fn(c.B, c.T, acc_bytes(c.dtype), sms)
        if (rt, chunk) != c.shape or rows != c.rows_per_block:
            problems.append(f"{c}: the plan launches ({rt}, {chunk}) with {rows} rows per block")
        reached.setdefault(c.dtype, set()).add((rt, chunk))
        if rows > 1 and blocks * rows == c.B:
            problems.append(f"{c}: every block is full (no row slot past B)")
    for dtype in DTYPES:
        full = 4 if acc_bytes(dtype) == 8 else 8
        want = {(32, full // 2), (32, full), (64, full), (128, full), (256, full),
                (256, full // 2)}
        missing = want - reached.get(dtype, set())
        if missing:
            problems.append(f"{dtype}: launch shapes never reached: {sorted(missing)}")
    return problems


def _close(got, want, tol):
    torch.testing.assert_close(got.cpu().double(), want.cpu().double(), rtol=tol, atol=tol * 10,
                               equal_nan=True)


def _tol(dtype, fp64, fp32):
    return {torch.float64: fp64, torch.float32: fp32}.get(dtype, 2e-2)


def gae_cases(sms: int, device: str) -> int:
    import hybridrl.kernels as K
    from hybridrl.kernels import reference as ref

    cases = gae_launch_cases(sms)
    for c in cases:
        dtype = DTYPES[c.dtype]
        g = torch.Generator().manual_seed(c.B * 7919 + c.T)
        r, v = torch.randn(c.B, c.T, generator=g), torch.randn(c.B, c.T, generator=g)
        m = torch.rand(c.B, c.T, generator=g)
        m[1:, c.T // 3:] = (m[1:, c.T // 3:] > 0.3).float()  # fractional, then holes
        got = K.gae(*(t.to(device, dtype) for t in (r, v, m)), 0.99, 0.95)
        want = ref.gae_ref(*(t.to(dtype).double() for t in (r, v, m)), 0.99, 0.95)
        tol = _tol(dtype, 1e-10, 2e-5)
        _close(got[0], want[0], tol)
        _close(got[1], want[1], tol)
    return f"{len(cases)} launches: 6 shapes x 4 dtypes, shared blocks ({sms} SMs)"


def _placed(values: torch.Tensor, dtype, offset: int, device: str) -> torch.Tensor:
    """``values`` on ``device`` as a contiguous view ``offset`` elements into its storage
    (offset 1: not 16-byte aligned, for every dtype)."""
    buf = torch.zeros(values.numel() + offset, device=device, dtype=dtype)
    view = buf[offset:]
    view.copy_(values)
    return view


def _kl_one(kind: str, dtype, n: int, offsets: tuple[int, int, int], seed: int,
            device: str) -> None:
    from hybridrl.kernels import reference as ref

    g = torch.Generator().manual_seed(seed)
    lp_vals = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    rl_vals = lp_vals + torch.randn(n, generator=g, dtype=torch.float64) * 3
    grad_vals = torch.randn(n, generator=g, dtype=torch.float64)
    buf = torch.zeros(n + offsets[0], device=device, dtype=dtype, requires_grad=True)
    with torch.no_grad():
        buf[offsets[0]:].copy_(lp_vals)
    lp = buf[offsets[0]:]  # a view: the op sees this storage offset, autograd reaches buf
    rl = _placed(rl_vals, dtype, offsets[1], device)
    grad = _placed(grad_vals, dtype, offsets[2], device)
    for t, off in zip((lp, rl, grad), offsets):
        assert (t.data_ptr() % 16 != 0) == (off == 1), ("alignment", kind, dtype, offsets)
    fwd, bwd = ref.parse_kl_kind(kind)
    out = torch.ops.hybridrl.kl_forward(lp, rl, fwd, bwd)  # the kernel for k1 as well
    out.backward(grad)
    y = lp.detach().double().clone().requires_grad_()
    want = ref.kl_penalty_ref(y, rl.double(), kind)
    want.backward(grad.double())
    tol = _tol(dtype, 1e-12, 1e-5)
    _close(out, want, tol)
    _close(buf.grad[offsets[0]:], y.grad, tol)


def kl_cases(sms: int, device: str) -> int:
    from hybridrl.kernels import reference as ref

    count = 0
    for dtype in DTYPES.values():
        for offsets in ((0, 0, 0), (1, 1, 1)):  # aligned; all three one element off
            for kind in KL_KINDS:
                _kl_one(kind, dtype, 1001, offsets, count, device)  # 1001: tails at every width
                count += 1
    for kind in ("k1", "k3", "k3+"):  # only the reference misaligned; lp misaligned, grad not
        _kl_one(kind, torch.float32, 1001, (0, 1, 0), count, device)
        _kl_one(kind, torch.float32, 1001, (1, 0, 0), count + 1, device)
        count += 2
    big = sms * 8 * 256 * 2 * 4 + 5  # fp32: more vectors than one grid pass covers, a tail
    _kl_one("k3", torch.float32, big, (0, 0, 0), 99, device)
    lp = torch.randn(333, device=device, dtype=torch.bfloat16)  # grad of another dtype
    rl = torch.randn(333, device=device, dtype=torch.bfloat16)
    g32 = torch.randn(333, device=device)
    got = torch.ops.hybridrl.kl_backward(g32, lp, rl, 3)  # 3: k3's backward
    want = torch.ops.hybridrl.kl_backward(g32.to(torch.bfloat16), lp, rl, 3)
    _close(got, want, 0.0)
    lp = torch.randn(500, device=device, dtype=torch.float64, requires_grad=True)
    rl = torch.randn(500, device=device, dtype=torch.float64)
    (g1,) = torch.autograd.grad(torch.ops.hybridrl.kl_forward(lp, rl, 3, 3).sum(), lp,
                                create_graph=True)
    (g2,) = torch.autograd.grad(g1.sum(), lp)
    lp2 = lp.detach().clone().requires_grad_()
    (w1,) = torch.autograd.grad(ref.kl_penalty_ref(lp2, rl, "k3").sum(), lp2, create_graph=True)
    (w2,) = torch.autograd.grad(w1.sum(), lp2)
    _close(g2, w2, 1e-12)
    return f"{count + 3} forward + backward cases, misaligned storage included"


def whiten_cases(sms: int, device: str) -> int:
    import hybridrl.kernels as K
    from hybridrl.kernels import reference as ref

    sizes = [(37, 301), (1, sms * 4 * 256 + 7), (1, sms * 8 * 256 * 2 + 3)]
    count = 0
    for dtype in DTYPES.values():
        for i, (rows, cols) in enumerate(sizes):
            if i == 2 and dtype != torch.float32:
                continue  # one multi-pass normalize is enough
            g = torch.Generator().manual_seed(cols)
            x = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 4 + 1
            m = (torch.rand(rows, cols, generator=g) > 0.4).double()
            got = K.masked_whiten(x.to(device, dtype), m.to(device, dtype))
            want = ref.masked_whiten_ref(x.to(dtype).double(), m)
            _close(got, want, _tol(dtype, 1e-12, 1e-5))
            count += 1
    for ones in (0, 1):
        mask = torch.zeros(4, 4, device=device)
        mask.view(-1)[:ones] = 1.0
        try:
            K.masked_whiten(torch.randn(4, 4, device=device), mask)
        except ValueError:
            count += 1
        else:
            raise AssertionError(f"masked_whiten: a mask summing to {ones} must raise ValueError")
    return f"{count} cases"


GROUPS = {"gae": gae_cases, "kl": kl_cases, "whiten": whiten_cases}


def main(argv=None) -> int:
    from hybridrl.kernels import ops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the same cases on the CPU kernels (tests the case code)")
    ap.add_argument("--only", default=",".join(GROUPS),
                    help="comma list of gae,kl,whiten (racecheck and synccheck need no kl: its "
                         "kernel has no shared memory and no barrier)")
    args = ap.parse_args(argv)
    device, only = args.device, [g for g in args.only.split(",") if g]
    if set(only) - set(GROUPS):
        ap.error(f"--only takes a comma list of {','.join(GROUPS)}, got {args.only!r}")
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (--device cpu runs the cases on the CPU kernels)")
        return 2
    if not all(ops.compiled_available(op, device) for op in ops.OP_NAMES):
        print(f"hybridrl {device} ops are not available (build the extension first)")
        return 2
    if device == "cuda":
        from hybridrl import _C_cuda

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        problems = coverage_problems(gae_launch_cases(sms), _C_cuda.gae_plan, sms)
        if problems:
            print("\n".join(f"COVERAGE: {p}" for p in problems))
            return 1
    else:
        sms = 132  # the H200's, for the same sizes
    try:
        for group in only:
            print(f"{group}: ok, {GROUPS[group](sms, device)}")
    except AssertionError as err:
        print(f"MISMATCH: {err}")
        return 1
    if device == "cuda":
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
