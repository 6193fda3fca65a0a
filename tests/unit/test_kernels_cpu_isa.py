"""The SIMD paths of the compiled CPU KL kernels (csrc/cpu/kl_spans.h): which one runs, and each
one forced, against the pure-torch reference.

- The best path this CPU has runs by default: "avx2" on a CPU with AVX2 + FMA + F16C and no
  AVX-512 (flags from /proc/cpuinfo, else torch's CPU capability).
- Every path the CPU can run, forced by HYBRIDRL_CPU_ISA in a fresh process (the path is fixed at
  the first KL call), gives the same bits as every other path (the loops are op for op the same,
  without FMA) and matches the reference: fp32 within 1e-6, bf16/fp16 equal to the fp32
  reference rounded once. Cases: every kind, forward and backward, clamp boundaries, NaN/inf,
  lengths 1..40 and 70001 (tails of the 4/8/16-lane loops), transposed and misaligned views.
- A path the CPU lacks, or an unknown name, raises ValueError naming the paths it has.
"""

import os
import platform
import subprocess
import sys

import pytest
import torch

from hybridrl.kernels import ops
from hybridrl.kernels import reference as ref

pytestmark = pytest.mark.skipif(not ops.compiled_available("kl_forward", "cpu"),
                                reason="hybridrl._C not built (pip install --no-build-isolation -e .)")

ENV = "HYBRIDRL_CPU_ISA"
KINDS = ["abs", "k2", "k3", "abs+", "k3+"]  # k1 never reaches the kernel (one subtraction)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    cap = torch.backends.cpu.get_cpu_capability()  # fallback: "AVX512", "AVX2", "DEFAULT"...
    avx2 = {"avx2", "fma", "f16c"}
    return avx2 | {"avx512f"} if cap == "AVX512" else (avx2 if cap == "AVX2" else set())


def _expected_paths() -> list[str]:
    """The paths this CPU can run, best first (the kernel's own choice rule)."""
    flags, paths = _cpu_flags(), []
    if platform.machine().lower() in ("x86_64", "amd64", "i686") and {"avx2", "fma", "f16c"} <= flags:
        paths += ["avx512"] if "avx512f" in flags else []
        paths += ["avx2"]
    return paths + ["baseline"]


def _cases():
    """[(name, layout, logprob, ref_logprob, grad_out)] (float64, contiguous): tails, edges, views."""
    g = torch.Generator().manual_seed(3)
    # ref - logp at both clamps (+-20 and beyond), around where the k3 value crosses 10 (2.6109,
    # -11.0000), logp = ref (the abs kink), |logp - ref| = 1000, NaN and infinite inputs
    edges = torch.tensor([[0.0, 20.0], [0.0, -20.0], [-5.0, 30.0], [1.0, -40.0], [0.0, 2.6108],
                          [0.0, 2.6110], [0.0, -10.9999], [0.0, -11.0001], [-1.0, -1.0],
                          [-1000.0, 0.0], [0.0, -1000.0], [0.0, float("nan")],
                          [float("-inf"), 0.0]], dtype=torch.float64)
    cases = []
    for n in list(range(1, 41)) + [70001]:
        lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
        rl = lp + torch.randn(n, generator=g, dtype=torch.float64) * 4
        m = min(n, len(edges))
        lp[:m], rl[:m] = edges[:m, 0], edges[:m, 1]
        cases.append((f"n{n}", "contiguous", lp, rl, torch.randn(n, generator=g).double()))
    for layout, shape in (("transposed", (37, 29)), ("misaligned", (1001,))):
        lp = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
        rl = lp + torch.randn(shape, generator=g, dtype=torch.float64) * 8
        cases.append((layout, layout, lp, rl, torch.randn(shape, generator=g).double()))
    return cases


def _view(t: torch.Tensor, dtype, layout: str) -> torch.Tensor:
    """t in dtype as a transposed view, a view one element into its storage, or contiguous."""
    if layout == "transposed":
        return t.t().contiguous().to(dtype).t()
    if layout == "misaligned":  # data pointer 1 element past an aligned allocation
        return torch.cat([torch.zeros(1, dtype=dtype), t.to(dtype)])[1:]
    return t.to(dtype)


def _run(fn, lp, rl, kind, grad_out):
    a, b = lp.detach().clone().requires_grad_(), rl.detach().clone().requires_grad_()
    out = fn(a, b, kind)
    out.backward(grad_out)
    return [out.detach(), a.grad, b.grad]


def compute_all() -> dict:
    """{(case, kind, dtype): [value, d logprob, d ref]} of hybridrl.kernels.kl_penalty."""
    import hybridrl.kernels as K

    results = {}
    for name, layout, lp, rl, grad in _cases():
        for dtype in DTYPES:
            lp_v, rl_v, grad_v = (_view(t, dtype, layout) for t in (lp, rl, grad))
            for kind in KINDS:
                results[(name, kind, str(dtype))] = _run(K.kl_penalty, lp_v, rl_v, kind, grad_v)
    return results


def _in_process(isa: str, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{ENV: isa})
    return subprocess.run([sys.executable, "-m", "tests.unit.test_kernels_cpu_isa", *argv],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_best_path_runs_by_default():
    if os.environ.get(ENV, "auto") != "auto":
        pytest.skip(f"{ENV} is set")
    want = _expected_paths()[0]
    assert ops.kl_cpu_isa() == want
    if {"avx2", "fma", "f16c"} <= _cpu_flags() and "avx512f" not in _cpu_flags():
        assert ops.kl_cpu_isa() == "avx2"


@pytest.fixture(scope="module")
def per_path_results(tmp_path_factory):
    results = {}
    for isa in _expected_paths():
        path = tmp_path_factory.mktemp("isa") / f"{isa}.pt"
        proc = _in_process(isa, str(path))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip() == isa
        results[isa] = torch.load(path)
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def test_every_path_gives_the_same_bits(per_path_results):
    (first, want), *others = per_path_results.items()
    for isa, results in others:
        for key, tensors in results.items():
            for got, w in zip(tensors, want[key]):
                assert torch.equal(_bits(got), _bits(w)), (isa, first, key)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_path_matches_the_reference(per_path_results, dtype):
    # bf16/fp16: the reference in fp32 on the same inputs, rounded once, within one unit of the
    # dtype (k3's exp may differ from torch.exp by 2 fp32 ulp, which can cross a rounding edge)
    tol = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}}.get(dtype, {})
    for isa, results in per_path_results.items():
        for name, layout, lp, rl, grad in _cases():
            lp_v, rl_v, grad_v = (_view(t, dtype, layout).float() for t in (lp, rl, grad))
            for kind in KINDS:
                want = _run(ref.kl_penalty_ref, lp_v, rl_v, kind, grad_v)
                for got, w in zip(results[(name, kind, str(dtype))], want):
                    assert got.dtype == dtype
                    where = f"{isa} {name} {kind}"
                    torch.testing.assert_close(got, w.to(dtype), equal_nan=True, **tol,
                                               msg=lambda m, where=where: f"{where}: {m}")


def test_unavailable_or_unknown_path_raises():
    missing = [p for p in ("avx512", "avx2") if p not in _expected_paths()] + ["avx1024"]
    proc = _in_process(missing[0], "-")
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and f"{ENV}={missing[0]}" in proc.stderr
    assert "baseline" in proc.stderr


if __name__ == "__main__":  # worker: run every case on the forced path, save, print the path
    out = sys.argv[1]
    results = compute_all() if out != "-" else {}
    print(ops.kl_cpu_isa())
    if out != "-":
        torch.save(results, out)
