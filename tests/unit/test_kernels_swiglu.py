"""The fused CPU SwiGLU and RoPE kernels (csrc/cpu/swiglu_cpu.cpp, hybridrl/kernels/swiglu.py)
against the eager formulas' autograd.

- swiglu(x) = silu(x[..., :f]) * x[..., f:] and its gradient: fp32 within 1e-6 (value) / 1e-5
  (gradient, whose 1 + g (1 - sig) cancels near g = -1.28) of eager torch; bf16/fp16 within one
  unit of the fp32 eager result rounded once, and equal to it in all but 0.5 % of the elements.
  Shapes [t, 2f], [t, 1, 2f], odd f (tails of the 4/8/16-lane loops), f = 1, transposed and
  sliced views, |gate| = 30, 88.7, 90, 1000 (sigmoid saturation and exp overflow: no NaN or inf
  where eager has none); NaN and ±inf where eager has them.
- apply_rope(x, cos, sin) = x * cos + rotate_half(x) * sin and its gradient in x: fp32 bit for
  bit, bf16/fp16 the fp32 eager result rounded once; x [t, heads, d], [t, 1, heads, d] and the
  local spec's strided [s, b, groups, heads + 1, d] view of the QKV projection, d = 64, 128, 74
  (half 37: a tail) and 2, cos/sin per token (as local_spec builds them, incl. a pack's
  gathered positions) or one row broadcast.
- Every SIMD path (HYBRIDRL_CPU_ISA forced in a fresh process) gives the same bits.
- The fallbacks (float64, cos/sin needing a gradient or broadcast otherwise) are the eager
  formula itself; an odd last dim is a ValueError; the ops pass torch.library.opcheck
  and trace under torch.compile(fullgraph=True).
"""

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridrl.kernels import ops
from hybridrl.kernels.swiglu import apply_rope, swiglu, swiglu_cpu_isa

pytestmark = pytest.mark.skipif(not ops.compiled_available("swiglu_fwd", "cpu"),
                                reason="hybridrl._C not built (pip install --no-build-isolation -e .)")

ENV = "HYBRIDRL_CPU_ISA"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL32 = {"rtol": 1e-6, "atol": 1e-6}
TOL32_GRAD = {"rtol": 1e-5, "atol": 1e-5}


def eager_swiglu(x):
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def eager_rope(x, cos, sin):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _swiglu_cases():
    """[(name, layout, x [..., 2f] float64, grad [..., f] float64)]."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for name, shape in (("t_2f", (67, 2048)), ("t_1_2f", (9, 1, 2048)), ("odd_f37", (13, 74)),
                        ("f1", (5, 2)), ("f_tail", (3, 2 * 53)), ("empty", (0, 8))):
        x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
        if x.numel():  # saturated gates, both signs, next to ordinary up values
            edges = torch.tensor([30.0, -30.0, 88.7, -88.7, 90.0, -90.0, 1000.0, -1000.0,
                                  -1.2785, 0.0], dtype=torch.float64)
            flat = x.view(-1, shape[-1])
            m = min(len(edges), shape[-1] // 2)
            flat[0, :m] = edges[:m]
        cases.append((name, "contiguous", x, torch.randn(*shape[:-1], shape[-1] // 2,
                                                         generator=g, dtype=torch.float64)))
    for layout in ("transposed", "sliced"):
        x = torch.randn(31, 2 * 45, generator=g, dtype=torch.float64) * 3
        cases.append((layout, layout, x, torch.randn(31, 45, generator=g, dtype=torch.float64)))
    return cases


def _x_view(x: torch.Tensor, dtype, layout: str) -> torch.Tensor:
    """x in dtype, as a transposed view, a column slice of a wider tensor, or contiguous."""
    if layout == "transposed":  # [t, 2f] with strides (1, t)
        return x.t().contiguous().to(dtype).t()
    if layout == "sliced":  # rows 7 elements apart, start one element into the storage
        wide = torch.zeros(x.shape[0], x.shape[1] + 7, dtype=dtype)
        wide[:, 1:1 + x.shape[1]] = x.to(dtype)
        return wide[:, 1:1 + x.shape[1]]
    return x.to(dtype)


def _rope_cases():
    """[(name, x float64 (maybe a strided view), cos, sin float64, grad float64)]."""
    g = torch.Generator().manual_seed(6)

    def angles(rows, d, lead):  # megatron's table: the same frequencies in both halves
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        pos = torch.randint(0, 300, (rows,), generator=g).double()  # a pack: any position
        f = torch.outer(pos, inv)
        return torch.cat((f, f), -1).reshape(rows, *([1] * lead), d)

    cases = []
    for name, shape in (("t_h_64", (41, 6, 64)), ("t_1_h_64", (33, 1, 10, 64)),
                        ("t_h_128", (17, 4, 128)), ("t_h_74", (19, 3, 74)), ("t_1_h_2", (5, 1, 3, 2))):
        f = angles(shape[0], shape[-1], len(shape) - 2)
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        cases.append((name, x, f.cos(), f.sin(), torch.randn(shape, generator=g).double()))
    # local_spec: mixed [s, b, groups, per_group + 2, hn], q and k heads = [..., :per_group + 1]
    mixed = torch.randn(23, 2, 2, 5, 64, generator=g, dtype=torch.float64)
    f = angles(23, 64, 3)
    cases.append(("qkv_view", mixed[:, :, :, :4], f.cos(), f.sin(),
                  torch.randn(23, 2, 2, 4, 64, generator=g).double()))
    f = angles(1, 64, 1)  # one row for every token
    x = torch.randn(7, 3, 64, generator=g, dtype=torch.float64)
    cases.append(("broadcast_row", x, f.cos(), f.sin(), torch.randn(7, 3, 64, generator=g).double()))
    return cases


def _run(fn, x, *args, grad):
    xr = x.detach().clone().requires_grad_() if x.is_contiguous() else x.detach().requires_grad_()
    out = fn(xr, *args)
    out.backward(grad)
    return [out.detach(), xr.grad]


def compute_all() -> dict:
    """{(op, case, dtype): [value, d x]} of the fused wrappers on the path this process runs."""
    results = {}
    for dtype in DTYPES:
        for name, layout, x, grad in _swiglu_cases():
            results[("swiglu", name, str(dtype))] = _run(swiglu, _x_view(x, dtype, layout),
                                                         grad=grad.to(dtype))
        for name, x, cos, sin, grad in _rope_cases():
            results[("rope", name, str(dtype))] = _run(
                apply_rope, x.to(dtype), cos.to(dtype), sin.to(dtype), grad=grad.to(dtype))
    return results


@pytest.fixture(scope="module")
def fused_results():
    return compute_all()


def _check_swiglu(results, dtype, where=""):
    for name, layout, x, grad in _swiglu_cases():
        want = _run(eager_swiglu, _x_view(x, dtype, layout).float(), grad=grad.to(dtype).float())
        got = results[("swiglu", name, str(dtype))]
        for i, (o, w) in enumerate(zip(got, want)):
            assert o.dtype == dtype and o.shape == w.shape
            assert torch.isfinite(o).all() == torch.isfinite(w).all(), (where, name, i)
            tol = (TOL32 if i == 0 else TOL32_GRAD) if dtype == torch.float32 else {}
            torch.testing.assert_close(o, w.to(dtype), **tol,
                                       msg=lambda m, n=name, i=i: f"{where} swiglu {n} [{i}]: {m}")
            if dtype != torch.float32:  # rounded once: off the rounded fp32 value only where
                # the fp32 results (~1e-6 apart) straddle a rounding edge of the dtype
                assert (o != w.to(dtype)).sum() <= max(2, o.numel() // 200), (where, name, i)


def _check_rope(results, dtype, where=""):
    for name, x, cos, sin, grad in _rope_cases():
        args = [t.to(dtype).float() for t in (x, cos, sin)]
        want = _run(eager_rope, *args, grad=grad.to(dtype).float())
        got = results[("rope", name, str(dtype))]
        for i, (o, w) in enumerate(zip(got, want)):
            assert o.dtype == dtype and o.shape == w.shape
            # the same products and sums as eager fp32: the same bits (bf16/fp16: rounded once)
            assert torch.equal(o, w.to(dtype)), (where, name, i, (o - w).abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_matches_eager_autograd(fused_results, dtype):
    _check_swiglu(fused_results, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_matches_eager_autograd(fused_results, dtype):
    _check_rope(fused_results, dtype)


def test_saturated_gates_are_finite_and_match():
    x = torch.tensor([[30.0, -30.0, 88.7, -88.7, 90.0, -90.0, 1e4, -1e4] + [2.0] * 8])
    xr = x.clone().requires_grad_()
    out = swiglu(xr)
    out.backward(torch.ones_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(xr.grad).all()
    xe = x.clone().requires_grad_()
    eager_swiglu(xe).backward(torch.ones_like(out))
    torch.testing.assert_close(out, eager_swiglu(x), **TOL32)
    torch.testing.assert_close(xr.grad, xe.grad, **TOL32_GRAD)


def test_nan_and_inf_propagate_as_in_eager():
    nan, inf = float("nan"), float("inf")
    vals = [nan, inf, -inf, 1.0, 2.0, nan, inf, -3.0]
    x = torch.tensor([vals + [1.0] * 8, [2.0] * 8 + vals])  # non-finite gates, then ups
    for xx in (x, x.flip(-1)):
        a, b = xx.clone().requires_grad_(), xx.clone().requires_grad_()
        out, want = swiglu(a), eager_swiglu(b)
        out.backward(torch.ones_like(out))
        want.backward(torch.ones_like(want))
        torch.testing.assert_close(out, want, equal_nan=True, **TOL32)
        torch.testing.assert_close(a.grad, b.grad, equal_nan=True, **TOL32_GRAD)


def test_rope_backward_takes_expanded_and_sliced_gradients():
    g = torch.Generator().manual_seed(9)
    mixed = torch.randn(5, 1, 2, 5, 64, generator=g)  # [s, b, groups, q 3 + k + v, hn]
    cos, sin = torch.rand(5, 1, 1, 1, 64, generator=g), torch.rand(5, 1, 1, 1, 64, generator=g)
    for reduce in (lambda o: o.sum(),  # an all-stride-0 gradient
                   lambda o: o[:, :, :, 3].sum()):  # zeros but for the key head
        a, b = mixed.clone().requires_grad_(), mixed.clone().requires_grad_()
        reduce(apply_rope(a[:, :, :, :4], cos, sin)).backward()
        reduce(eager_rope(b[:, :, :, :4], cos, sin)).backward()
        assert torch.equal(a.grad, b.grad)


def test_fallbacks_are_the_eager_formula():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 20, generator=g, dtype=torch.float64)
    assert torch.equal(swiglu(x), eager_swiglu(x))  # float64: eager torch itself
    q = torch.randn(6, 2, 8, generator=g)
    cos, sin = torch.randn(6, 1, 8, generator=g), torch.randn(6, 1, 8, generator=g)
    c = cos.clone().requires_grad_()  # a table that needs a gradient gets one, through eager
    out = apply_rope(q, c, sin)
    out.sum().backward()
    want = cos.clone().requires_grad_()
    eager_rope(q, want, sin).sum().backward()
    assert torch.equal(c.grad, want.grad)
    per_head = torch.randn(1, 2, 8, generator=g)  # varies by head: not the kernel's layout
    assert torch.equal(apply_rope(q, per_head, sin), eager_rope(q, per_head, sin))
    assert torch.equal(apply_rope(q, cos.double(), sin), eager_rope(q, cos.double(), sin))


def test_no_grad_calls_the_op_directly_and_matches():
    x = torch.randn(4, 1, 64)
    with torch.no_grad():
        assert torch.equal(swiglu(x), torch.ops.hybridrl.swiglu_fwd(x))
    q, cos, sin = torch.randn(4, 3, 64), torch.rand(4, 1, 64), torch.rand(4, 1, 64)
    assert torch.equal(apply_rope(q, cos, sin), eager_rope(q, cos, sin))


def test_odd_last_dim_is_a_value_error():
    with pytest.raises(ValueError, match="must be even"):
        swiglu(torch.randn(3, 7))
    with pytest.raises(ValueError, match="must be even"):
        apply_rope(torch.randn(3, 2, 7), torch.randn(3, 1, 7), torch.randn(3, 1, 7))
    with pytest.raises(ValueError, match="must be even"):  # the op itself, called directly
        torch.ops.hybridrl.rope_fwd(torch.randn(3, 2, 7), torch.randn(3, 1, 7), torch.randn(3, 1, 7))
    with pytest.raises(ValueError, match="cos/sin must be"):
        torch.ops.hybridrl.rope_fwd(torch.randn(3, 2, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))


def test_opcheck():
    x = torch.randn(5, 2, 18)  # the ops have no autograd kernel: the wrappers' Functions do
    torch.library.opcheck(torch.ops.hybridrl.swiglu_fwd.default, (x,))
    torch.library.opcheck(torch.ops.hybridrl.swiglu_bwd.default, (torch.randn(5, 2, 9), x))
    q, cos, sin = torch.randn(5, 3, 12), torch.randn(5, 1, 12), torch.randn(5, 1, 12)
    torch.library.opcheck(torch.ops.hybridrl.rope_fwd.default, (q, cos, sin))
    torch.library.opcheck(torch.ops.hybridrl.rope_bwd.default, (q, cos, sin))


def test_traces_under_torch_compile_fullgraph():
    def loss(x, q, cos, sin):
        return swiglu(x).sum() + apply_rope(q, cos, sin).square().sum()

    g = torch.Generator().manual_seed(8)
    x = torch.randn(8, 1, 36, generator=g, requires_grad=True)
    q = torch.randn(8, 2, 3, 16, generator=g, requires_grad=True)
    cos, sin = torch.rand(8, 1, 1, 16, generator=g), torch.rand(8, 1, 1, 16, generator=g)
    out = torch.compile(loss, backend="aot_eager", fullgraph=True)(x, q, cos, sin)
    out.backward()
    grads = x.grad.clone(), q.grad.clone()
    x.grad = q.grad = None
    want = loss(x, q, cos, sin)
    want.backward()
    assert torch.equal(out, want) and torch.equal(grads[0], x.grad) and torch.equal(grads[1], q.grad)


# ---- every SIMD path, forced in a fresh process ----

def _expected_paths() -> list[str]:
    """The paths this CPU can run, best first (the kernel's rule, kl_cpu.cpp's too)."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")),
                         set())
    except OSError:
        cap = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT"...
        flags = {"avx2", "fma", "f16c"} if cap in ("AVX2", "AVX512") else set()
        flags |= {"avx512f"} if cap == "AVX512" else set()
    paths = []
    if platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma", "f16c"} <= flags:
        paths += (["avx512"] if "avx512f" in flags else []) + ["avx2"]
    return paths + ["baseline"]


def _in_process(isa: str, out: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{ENV: isa})
    return subprocess.run([sys.executable, "-m", "tests.unit.test_kernels_swiglu", out],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_every_path_matches_eager_with_the_same_bits(tmp_path, fused_results):
    if os.environ.get(ENV, "auto") == "auto":
        assert swiglu_cpu_isa() == _expected_paths()[0]
    for isa in _expected_paths():
        proc = _in_process(isa, str(tmp_path / f"{isa}.pt"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip() == isa
        results = torch.load(tmp_path / f"{isa}.pt")
        for key, tensors in results.items():
            for got, want in zip(tensors, fused_results[key]):
                assert torch.equal(got, want), (isa, key)
        _check_swiglu(results, torch.float32, isa)  # (the same bits: the rest follows)
    missing = [p for p in ("avx512", "avx2") if p not in _expected_paths()] + ["avx1024"]
    proc = _in_process(missing[0], "-")
    assert proc.returncode != 0 and f"{ENV}={missing[0]}" in proc.stderr
    assert "ValueError" in proc.stderr and "baseline" in proc.stderr


if __name__ == "__main__":  # worker: every case on the forced path, saved; prints the path
    out = sys.argv[1]
    results = compute_all() if out != "-" else {}
    print(swiglu_cpu_isa())
    if out != "-":
        torch.save(results, out)
