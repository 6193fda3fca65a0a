"""Benchmark of the csrc kernels against their pure-torch references, side by side.

Contract: prints, for each B x T, the compiled op's time, the reference's time (GAE: verl's
Python time-step loop; KL: eager torch forward + backward; whitening: eager torch), their ratio
and the compiled op's achieved bandwidth (minimal bytes moved / time), on cuda also as a fraction
of --peak-gbs (default 4800, the H200's HBM3e). Times are the minimum over --repeat alternating
runs of both sides after one warm-up (a slow reference stops repeating after ~2 s); the header
prints the machine's load average, since a shared machine skews timings, and on cpu the SIMD
path the KL kernels took ("avx512", "avx2" or "baseline"; HYBRIDRL_CPU_ISA forces one). The compiled ops must be
built (``pip install --no-build-isolation -e .``); otherwise the script says so and exits.

The swiglu and rope cells (cpu, fixed shapes: SwiGLU x [1000, 2048] = gate|up of FFN 1024, RoPE
on q+k heads [1000, 1, 10, 64] with a per-token table) time eager autograd (chunk/silu/mul,
rotate_half) against hybridrl.kernels.swiglu's fused ops, forward and forward + backward, in
process CPU time (time.process_time: steadier than wall time on a loaded machine), with the
SIMD path they took.

    python -m benchmarks.kernels --only swiglu,rope --dtype float32

The rmsnorm cell (cpu, fp32, x [1000, 384] and [800, 6, 64]; benchmarks/kernels_rmsnorm.py) times
eager F.rms_norm autograd, a torch-level fused Function (ATen's fused forward + the closed-form
backward in eager ops) and hybridrl.kernels.norm's C++ ops, no-grad forward, forward and
forward + backward, in process CPU time, with the SIMD path:

    OMP_NUM_THREADS=1 python -m benchmarks.kernels --only rmsnorm --threads 1

    python -m benchmarks.kernels --sizes 256x512,1024x1024 --device cpu
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import hybridrl.kernels as K
from hybridrl.kernels import ops, reference

DEFAULT_SIZES = "256x512,1024x1024,1024x4096,4096x8192"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_pair(fast, slow, device: str, repeat: int,
               clock=time.perf_counter) -> tuple[float, float]:
    """Minimum seconds of fast() and slow() over up to repeat alternating runs (after a warm-up).

    Alternating the two sides exposes both to the same background load; the slow side stops
    repeating once it has spent ~2 s.
    """
    best = [float("inf"), float("inf")]
    spent_slow = 0.0
    for rep in range(repeat + 1):
        for side, fn in enumerate((fast, slow)):
            if side == 1 and spent_slow > 2.0:
                continue
            _sync(device)
            start = clock()
            fn()
            _sync(device)
            elapsed = clock() - start
            if side == 1:
                spent_slow += elapsed
            if rep > 0 or (side == 1 and spent_slow > 2.0):  # rep 0 warms up (unless too slow)
                best[side] = min(best[side], elapsed)
    return best[0], best[1]


PEAK_GBS = 0.0  # --peak-gbs: the memory bandwidth to report a fraction of (0: none)


def _row(name: str, B: int, T: int, fast: float, slow: float, nbytes: int) -> str:
    gbs = nbytes / fast / 1e9
    peak = f" = {100 * gbs / PEAK_GBS:3.0f}% of {PEAK_GBS:.0f}" if PEAK_GBS > 0 else ""
    return (f"{name:<10} {B:>5}x{T:<5} compiled {fast * 1e3:9.3f} ms   reference "
            f"{slow * 1e3:10.3f} ms   ratio {slow / fast:8.1f}x   {gbs:7.1f} GB/s{peak}")


def bench_gae(B: int, T: int, device: str, dtype, repeat: int) -> str:
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(B, T, generator=gen).to(device, dtype)
    v = torch.randn(B, T, generator=gen).to(device, dtype)
    lengths = torch.randint(1, T + 1, (B, 1), generator=gen)
    m = (torch.arange(T)[None, :] < lengths).to(device, dtype)  # right-padded responses
    fast, slow = _time_pair(lambda: K.gae(r, v, m, 1.0, 0.95),
                            lambda: reference.gae_ref(r, v, m, 1.0, 0.95), device, repeat)
    nbytes = 5 * B * T * r.element_size()  # read rewards, values, mask; write adv, returns
    return _row("gae", B, T, fast, slow, nbytes)


def bench_kl(B: int, T: int, device: str, dtype, repeat: int, kind: str) -> str:
    gen = torch.Generator().manual_seed(1)
    lp = (-torch.rand(B, T, generator=gen) * 3).to(device, dtype).requires_grad_()
    rl = (-torch.rand(B, T, generator=gen) * 3).to(device, dtype)
    grad = torch.ones(B, T, device=device, dtype=dtype)

    def run(fn):
        def step():
            lp.grad = None
            fn(lp, rl, kind).backward(grad)
        return step

    fast, slow = _time_pair(run(K.kl_penalty), run(reference.kl_penalty_ref), device, repeat)
    nbytes = 7 * B * T * lp.element_size()  # fwd: 2 in + 1 out; bwd: 3 in + 1 out
    return _row(f"kl[{kind}]", B, T, fast, slow, nbytes)


def bench_whiten(B: int, T: int, device: str, dtype, repeat: int) -> str:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, generator=gen).to(device, dtype)
    m = (torch.rand(B, T, generator=gen) > 0.3).to(device, dtype)
    fast, slow = _time_pair(lambda: K.masked_whiten(x, m),
                            lambda: reference.masked_whiten_ref(x, m), device, repeat)
    nbytes = 3 * B * T * x.element_size()  # read values, mask; write output (one-pass minimum)
    return _row("whiten", B, T, fast, slow, nbytes)


def _act_row(name: str, fast: float, slow: float) -> str:
    return (f"{name:<24} fused {fast * 1e3:8.3f} ms   eager {slow * 1e3:8.3f} ms   "
            f"ratio {slow / fast:5.2f}x")


def bench_swiglu(dtype, repeat: int) -> list[str]:
    """SwiGLU on x [1000, 2048]: forward, and forward + backward (CPU seconds, min of repeat)."""
    from hybridrl.kernels.swiglu import swiglu

    x = torch.randn(1000, 2048, generator=torch.Generator().manual_seed(3)).to(dtype)
    xg = x.clone().requires_grad_()
    grad = torch.randn(1000, 1024, dtype=dtype)

    def eager(t):
        gate, up = torch.chunk(t, 2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def step(fn):
        def run():
            xg.grad = None
            fn(xg).backward(grad)
        return run

    rows = []
    with torch.no_grad():
        fast, slow = _time_pair(lambda: swiglu(x), lambda: eager(x), "cpu", repeat,
                                time.process_time)
    rows.append(_act_row("swiglu [1000,2048] fwd", fast, slow))
    fast, slow = _time_pair(step(swiglu), step(eager), "cpu", repeat, time.process_time)
    rows.append(_act_row("swiglu [1000,2048] f+b", fast, slow))
    return rows


def bench_rope(dtype, repeat: int) -> list[str]:
    """RoPE on the q+k heads [1000, 1, 10, 64] (a strided view of a QKV projection, as the
    local spec rotates them) with a per-token cos/sin [1000, 1, 1, 64]."""
    from hybridrl.kernels.swiglu import apply_rope

    gen = torch.Generator().manual_seed(4)
    mixed = torch.randn(1000, 1, 12, 64, generator=gen).to(dtype)  # q 8 + k 2 + v 2 heads
    qk = mixed[:, :, :10]
    ang = torch.rand(1000, 1, 1, 64, generator=gen) * 100
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    mg = mixed.clone().requires_grad_()
    grad = torch.randn(1000, 1, 10, 64, dtype=dtype)

    def eager(t):
        x1, x2 = torch.chunk(t, 2, dim=-1)
        return t * cos + torch.cat((-x2, x1), dim=-1) * sin

    def step(fn):
        def run():
            mg.grad = None
            fn(mg[:, :, :10]).backward(grad)
        return run

    rows = []
    with torch.no_grad():
        fast, slow = _time_pair(lambda: apply_rope(qk, cos, sin), lambda: eager(qk), "cpu",
                                repeat, time.process_time)
    rows.append(_act_row("rope q+k [1000,1,10,64] fwd", fast, slow))
    fast, slow = _time_pair(step(lambda t: apply_rope(t, cos, sin)), step(eager), "cpu", repeat,
                            time.process_time)
    rows.append(_act_row("rope q+k [1000,1,10,64] f+b", fast, slow))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list of BxT")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--kinds", default="low_var_kl", help="comma list of KL kinds")
    parser.add_argument("--only", default="gae,kl,whiten,swiglu,rope,rmsnorm",
                        help="comma list of gae,kl,whiten,swiglu,rope,rmsnorm")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--peak-gbs", type=float, default=None,
                        help="memory bandwidth (GB/s) to print each op's fraction of; default "
                             "4800 (H200 HBM3e) on cuda, none on cpu")
    args = parser.parse_args(argv)
    global PEAK_GBS
    PEAK_GBS = args.peak_gbs if args.peak_gbs is not None else (
        4800.0 if args.device == "cuda" else 0.0)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not ops.compiled_available("gae", args.device):
        raise SystemExit(f"compiled hybridrl ops are not built for {args.device}; run "
                         "`pip install --no-build-isolation -e .` first")
    dtype = getattr(torch, args.dtype)
    only = set(args.only.split(","))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    isa = f", KL path {ops.kl_cpu_isa()}" if args.device == "cpu" else ""
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"dtype {args.dtype}, min of {args.repeat} alternating runs, load average {load:.1f}"
          f"{isa}")
    for size in args.sizes.split(","):
        B, T = (int(s) for s in size.lower().split("x"))
        if "gae" in only:
            print(bench_gae(B, T, args.device, dtype, args.repeat), flush=True)
        if "kl" in only:
            for kind in args.kinds.split(","):
                print(bench_kl(B, T, args.device, dtype, args.repeat, kind), flush=True)
        if "whiten" in only:
            print(bench_whiten(B, T, args.device, dtype, args.repeat), flush=True)
    if args.device == "cpu" and only & {"swiglu", "rope"}:
        from hybridrl.kernels.swiglu import swiglu_cpu_isa

        print(f"swiglu/rope: process CPU time, SIMD path {swiglu_cpu_isa()}", flush=True)
        for name, bench in (("swiglu", bench_swiglu), ("rope", bench_rope)):
            if name in only:
                for row in bench(dtype, args.repeat):
                    print(row, flush=True)

    if args.device == "cpu" and "rmsnorm" in only:
        from benchmarks.kernels_rmsnorm import bench_rmsnorm

        for row in bench_rmsnorm(args.repeat):
            print(row, flush=True)


if __name__ == "__main__":
    main()
