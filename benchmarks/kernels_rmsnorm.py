"""The RMSNorm cell of benchmarks/kernels.py: eager autograd vs a torch-level fused Function vs
the C++ kernel (hybridrl.kernels.norm), on CPU, three sides in one run.

Contract: for x [1000, 384] (the hidden states of the 12.6M llama of trl_compare's realistic cell)
and [800, 6, 64] (a Qwen3 q/k norm over heads of 64), fp32, weight [h] requiring grad, prints the
milliseconds of each side and the ratios eager / C++ and torch-fn / C++ for:
- ``fwd no-grad`` (rollout and reference forwards): ``F.rms_norm`` (ATen's fused forward),
  ``aten._fused_rms_norm`` (the same kernel), ``rms_norm`` (the C++ op without autograd);
- ``fwd`` (a training forward, no backward): inputs require grad, so ``F.rms_norm`` runs its
  eager decomposition (~6 ops) recording the graph;
- ``fwd+bwd``: the same forward, then backward of a fixed upstream gradient;
plus one row of bf16 x [1000, 384] with an fp32 weight (megatron's local spec under bf16),
fwd+bwd, torch's mixed-dtype path vs the C++ op.
The middle side ("torch-fn") is a ``torch.autograd.Function``: ``aten._fused_rms_norm`` forward
and the closed-form backward in ~7 eager ops (xh = x rstd; gw = g w; dot = mean(gw xh);
dx = (gw - xh dot) rstd; dw = sum over rows of g xh). Times are process CPU seconds
(``time.process_time``: steadier than wall time on a shared machine), the minimum over --repeat
alternating rounds of ``inner`` calls each after one warm-up round; the header names the SIMD path.

    OMP_NUM_THREADS=1 python -m benchmarks.kernels --only rmsnorm --threads 1
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

from hybridrl.kernels import norm

SHAPES = ((1000, 384), (800, 6, 64))
EPS = 1e-6


class TorchFusedRMSNorm(torch.autograd.Function):
    """ATen's fused forward and the closed-form backward in eager ops (the middle comparator)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        xh = x * rstd
        gw = grad * weight
        dot = (gw * xh).mean(-1, keepdim=True)
        dx = (gw - xh * dot) * rstd
        dw = (grad * xh).reshape(-1, x.shape[-1]).sum(0)
        return dx, dw, None


def _time_sides(fns, repeat: int, inner: int) -> list[float]:
    """Minimum process CPU seconds per call of each fn over repeat alternating rounds."""
    best = [float("inf")] * len(fns)
    for rnd in range(repeat + 1):
        for k, fn in enumerate(fns):
            start = time.process_time()
            for _ in range(inner):
                fn()
            elapsed = (time.process_time() - start) / inner
            if rnd > 0:  # round 0 warms up
                best[k] = min(best[k], elapsed)
    return best


def _row(label: str, times: list[float]) -> str:
    eager, tfn, ext = times
    return (f"{label:<30} eager {eager * 1e3:7.3f} ms   torch-fn {tfn * 1e3:7.3f} ms   "
            f"C++ {ext * 1e3:7.3f} ms   eager/C++ {eager / ext:5.2f}x   "
            f"torch-fn/C++ {tfn / ext:5.2f}x")


def _shape_rows(shape: tuple[int, ...], gen: torch.Generator, repeat: int,
                inner: int) -> list[str]:
    h = shape[-1]
    x = torch.randn(shape, generator=gen)
    w = (1 + 0.1 * torch.randn(h, generator=gen)).requires_grad_()
    xg = x.clone().requires_grad_()
    grad = torch.randn(shape, generator=gen)
    sides = (lambda a, b: F.rms_norm(a, (h,), b, EPS),
             lambda a, b: TorchFusedRMSNorm.apply(a, b, EPS),
             lambda a, b: norm.rms_norm(a, b, EPS))

    def nograd(fn):
        def run():
            with torch.no_grad():
                fn(x, w)
        return run

    def fwd(fn):
        return lambda: fn(xg, w)

    def step(fn):
        def run():
            xg.grad = w.grad = None
            fn(xg, w).backward(grad)
        return run

    name = "x".join(str(s) for s in shape)
    return [_row(f"rmsnorm [{name}] {label}", _time_sides([wrap(fn) for fn in sides], repeat, inner))
            for label, wrap in (("fwd no-grad", nograd), ("fwd", fwd), ("fwd+bwd", step))]


def _mixed_row(gen: torch.Generator, repeat: int, inner: int) -> str:
    """bf16 x [1000, 384] with an fp32 weight (megatron's local spec under bf16), fwd+bwd:
    torch's mixed-dtype path (F.rms_norm's decomposition) vs the C++ op."""
    x = torch.randn(1000, 384, generator=gen).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(384, generator=gen)).requires_grad_()
    grad = torch.randn(1000, 384, generator=gen).bfloat16()

    def step(fn):
        def run():
            x.grad = w.grad = None
            fn(x, w).backward(grad)
        return run

    with warnings.catch_warnings():  # torch warns once that it cannot fuse mixed dtypes
        warnings.simplefilter("ignore")
        eager, ext = _time_sides([step(lambda a, b: F.rms_norm(a, (384,), b, EPS)),
                                  step(lambda a, b: norm.rms_norm(a, b, EPS))], repeat, inner)
    return (f"{'rmsnorm [1000x384] bf16 x, fp32 w, fwd+bwd':<44} eager {eager * 1e3:7.3f} ms   "
            f"C++ {ext * 1e3:7.3f} ms   eager/C++ {eager / ext:5.2f}x")


def bench_rmsnorm(repeat: int, inner: int = 20) -> list[str]:
    """The cell's rows (module doc), fp32 on CPU."""
    from hybridrl.kernels import ops

    rows = [f"rmsnorm: process CPU time per call, min of {repeat} rounds x {inner} calls, "
            f"threads {torch.get_num_threads()}, SIMD path {torch.ops.hybridrl.rms_norm_cpu_isa()}"
            if ops.compiled_available("rms_norm_fwd", "cpu") else
            "rmsnorm: the C++ ops are not built: the C++ side runs F.rms_norm"]
    gen = torch.Generator().manual_seed(5)
    for shape in SHAPES:
        rows += _shape_rows(shape, gen, repeat, inner)
    rows.append(_mixed_row(gen, repeat, inner))
    return rows


if __name__ == "__main__":
    for line in bench_rmsnorm(20):
        print(line, flush=True)
