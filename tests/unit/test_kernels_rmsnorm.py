"""The fused CPU RMSNorm (csrc/cpu/rmsnorm_cpu.cpp, hybridrl/kernels/norm.py) against torch.

- ``rms_norm``'s output and both gradients equal ``F.rms_norm``'s autograd: fp32 within 1e-6
  (output) / 1e-5 (gradients), bf16 and fp16 equal to the fp32 formula on the same inputs rounded
  once (within torch's tolerance, and bit-equal in >= 99.5 % of the elements); shapes [t, h],
  [t, 1, h] and [t, heads, 64] (Qwen3's q/k norm), hidden sizes 1, 37, 64, 384, 1000 (tails of
  the 4/8/16-lane loops and of the 32-lane sums), a transposed x and a transposed upstream
  gradient, weight None, 700 rows (11 weight-gradient blocks).
- Every SIMD path this CPU runs (the ops' ``isa`` argument) gives the same bits as every other;
  the default path is the best one, or the one HYBRIDRL_CPU_ISA names (a fresh process).
- The weight gradient's bits do not depend on the thread count.
- An fp32 weight with bf16/fp16 x (megatron's local spec) runs the fused op: the fp32 formula
  rounded once, dw in fp32, within 2 ulps of torch's mixed-dtype path.
- ``eps=None`` is ``F.rms_norm``'s default; fp64, other dtype mixes and a wrong weight go to
  ``F.rms_norm`` itself; no_grad calls make no autograd node; second derivatives (create_graph=True) are torch's.
- ``FusedRMSNorm`` is ``nn.RMSNorm`` (state_dict both ways, init, extra_repr, multi-dim
  ``normalized_shape``, no affine) with the same numbers; the fake kernels pass opcheck, and
  torch.compile(fullgraph=True) traces both ops into its forward and backward graphs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridrl.kernels import norm, ops
from tests.unit.test_kernels_cpu_isa import _expected_paths

pytestmark = pytest.mark.skipif(not ops.compiled_available("rms_norm_fwd", "cpu"),
                                reason="hybridrl._C not built (pip install --no-build-isolation -e .)")

TOL = {torch.float32: [{"rtol": 1e-6, "atol": 1e-6}, {"rtol": 1e-5, "atol": 1e-5}]}


def _cases():
    """[(name, x fp64 [*, h] in its layout, grad_out fp64 in its layout, has_weight)]."""
    g = torch.Generator().manual_seed(7)
    cases = []
    for h in (1, 37, 64, 384, 1000):
        for shape in ((23, h), (19, 1, h)):
            x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.3
            go = torch.randn(shape, generator=g, dtype=torch.float64)
            cases += [(f"{shape}", x, go, True), (f"{shape} no weight", x, go, False)]
    heads = torch.randn(50, 6, 64, generator=g, dtype=torch.float64)  # Qwen3 q/k norm
    cases.append(("[50, 6, 64]", heads, torch.randn(50, 6, 64, generator=g).double(), True))
    x_t = torch.randn(384, 41, generator=g, dtype=torch.float64).t()  # non-contiguous x
    go_t = torch.randn(384, 41, generator=g, dtype=torch.float64).t()  # and upstream gradient
    cases.append(("transposed", x_t, go_t, True))
    cases.append(("rows 700 (11 weight blocks)", torch.randn(700, 96, generator=g).double(),
                  torch.randn(700, 96, generator=g).double(), True))
    return cases


def _weight(h: int) -> torch.Tensor:
    return 1 + 0.5 * torch.randn(h, generator=torch.Generator().manual_seed(h), dtype=torch.float64)


def _grads(fn, x, w, go):
    """(out, dx, dw) of fn(x, w) with leaf copies of x and w; go is the upstream gradient."""
    x = x.detach().clone().requires_grad_()
    w = None if w is None else w.detach().clone().requires_grad_()
    out = fn(x, w)
    out.backward(go)
    return [out.detach(), x.grad, None if w is None else w.grad]


def _layout(t: torch.Tensor, like: torch.Tensor, dtype) -> torch.Tensor:
    """t in dtype, transposed the way `like` is (a transposed 2-D view stays one)."""
    if like.dim() == 2 and not like.is_contiguous():
        return t.t().contiguous().to(dtype).t()
    return t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_torch_autograd(dtype):
    eps, counts = 1e-6, [0, 0]  # bf16/fp16: elements unequal to the rounded oracle, all elements
    for name, x, go, has_w in _cases():
        xv, gv = _layout(x, x, dtype), _layout(go, go, dtype)
        w = _weight(x.shape[-1]).to(dtype) if has_w else None
        assert (name != "transposed") == xv.is_contiguous()
        got = _grads(lambda a, b: norm.rms_norm(a, b, eps), xv, w, gv)
        # the oracle: torch's autograd of F.rms_norm, in fp32 on the same (rounded) inputs
        want = _grads(lambda a, b: F.rms_norm(a, a.shape[-1:], b, eps), xv.float(),
                      None if w is None else w.float(), gv.float())
        for k, (a, b) in enumerate(zip(got, want)):
            if b is None:
                assert a is None, name
                continue
            assert a.dtype == dtype and a.shape == b.shape, name
            tol = TOL[dtype][min(k, 1)] if dtype in TOL else {}
            torch.testing.assert_close(a, b.to(dtype), **tol,
                                       msg=lambda m, k=k, name=name: f"{name} [{k}]: {m}")
            counts[0] += (a != b.to(dtype)).sum().item()
            counts[1] += a.numel()
    if dtype not in TOL:  # rounded once from the same fp32 values, but for rounding-edge cases
        assert counts[0] <= 0.005 * counts[1], counts


def test_every_path_gives_the_same_bits():
    paths = _expected_paths()
    for name, x, go, has_w in _cases():
        for dtype in (torch.float32, torch.bfloat16):
            xv, gv = _layout(x, x, dtype), _layout(go, go, dtype)
            w = _weight(x.shape[-1]).to(dtype) if has_w else None
            outs = {}
            for isa in paths:
                out, rstd = torch.ops.hybridrl.rms_norm_fwd(xv, w, 1e-5, isa)
                dx, dw = torch.ops.hybridrl.rms_norm_bwd(gv, xv, rstd, w, isa)
                outs[isa] = [t for t in (out, rstd, dx, dw) if t is not None]
            first = outs[paths[0]]
            for isa in paths[1:]:
                for a, b in zip(outs[isa], first):
                    assert torch.equal(a, b), (name, dtype, isa, paths[0])


def test_default_path_is_the_best_or_the_forced_one():
    if os.environ.get("HYBRIDRL_CPU_ISA", "auto") == "auto":
        assert torch.ops.hybridrl.rms_norm_cpu_isa() == _expected_paths()[0]
    forced = _expected_paths()[-1]  # "baseline"; in a fresh process: read at the first call
    code = ("import torch; from hybridrl.kernels import norm; x = torch.randn(3, 8); "
            "norm.rms_norm(x); print(torch.ops.hybridrl.rms_norm_cpu_isa())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, HYBRIDRL_CPU_ISA=forced), timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == forced, proc.stderr[-2000:]


def test_unknown_path_and_bad_inputs_raise_value_errors():
    x = torch.randn(4, 8)
    missing = [p for p in ("avx512", "avx2") if p not in _expected_paths()] + ["avx1024"]
    with pytest.raises(ValueError, match=f"isa={missing[0]} is not .*baseline"):
        torch.ops.hybridrl.rms_norm_fwd(x, None, 1e-6, missing[0])
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        torch.ops.hybridrl.rms_norm_fwd(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="must be float32, bfloat16 or float16"):
        torch.ops.hybridrl.rms_norm_fwd(x.double(), None, 1e-6)
    with pytest.raises(ValueError, match="grad must have the shape of x"):
        torch.ops.hybridrl.rms_norm_bwd(torch.ones(4, 7), x, torch.ones(4), None)


def test_weight_gradient_bits_do_not_depend_on_threads():
    g = torch.Generator().manual_seed(1)
    x, go, w = torch.randn(2000, 384, generator=g), torch.randn(2000, 384, generator=g), _weight(384)
    w = w.float()
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(_grads(lambda a, b: norm.rms_norm(a, b, 1e-6), x, w, go))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            assert torch.equal(a, b)


def test_eps_none_is_torch_default():
    x = torch.randn(6, 384, generator=torch.Generator().manual_seed(2)) * 1e-4  # eps matters
    for dtype in (torch.float32, torch.bfloat16):
        xv = x.to(dtype)
        want = F.rms_norm(xv, (384,), None, None)
        torch.testing.assert_close(norm.rms_norm(xv), want, rtol=1e-6, atol=0)
        assert not torch.allclose(norm.rms_norm(xv, eps=1e-6).float(), want.float(), rtol=1e-3)


def test_other_inputs_run_torch_and_no_grad_makes_no_node():
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.rand(16, dtype=torch.float64, requires_grad=True)
    assert torch.equal(norm.rms_norm(x, w, 1e-6), F.rms_norm(x, (16,), w, 1e-6))
    assert "RMSNormFunction" not in type(norm.rms_norm(x, w, 1e-6).grad_fn).__name__
    xf = x.detach().float().requires_grad_()
    assert torch.equal(norm.rms_norm(xf, w, 1e-6), F.rms_norm(xf, (16,), w, 1e-6))  # mixed dtypes
    with pytest.raises(RuntimeError):  # torch's own error for a wrong weight
        norm.rms_norm(xf, torch.ones(15), 1e-6)
    assert "RMSNormFunction" in type(norm.rms_norm(xf, None, 1e-6).grad_fn).__name__
    with torch.no_grad():
        out = norm.rms_norm(xf, w.detach().float(), 1e-6)
    assert out.grad_fn is None
    torch.testing.assert_close(out, F.rms_norm(xf.detach(), (16,), w.detach().float(), 1e-6),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_weight_with_16_bit_x_is_fused(dtype):
    """megatron's local spec: fp32 norm weights under bf16 activations run the fused op; output
    and dx are the fp32 formula rounded once, dw comes back in fp32; against torch's mixed-dtype
    path (which rounds x * rstd before the weight) the output is at most 2 ulps off and equal
    in >= 95 % of the elements."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(300, 384, generator=g) * 2 + 0.3).to(dtype)
    go = torch.randn(300, 384, generator=g).to(dtype)
    w = 1 + 0.5 * torch.randn(384, generator=g)
    got = _grads(lambda a, b: norm.rms_norm(a, b, 1e-6), x, w, go)
    want = _grads(lambda a, b: F.rms_norm(a, (384,), b, 1e-6), x.float(), w, go.float())
    assert [t.dtype for t in got] == [dtype, dtype, torch.float32]
    for k in (0, 1):  # output, dx: the oracle rounded once, but for rounding-edge cases
        torch.testing.assert_close(got[k], want[k].to(dtype))
        assert (got[k] != want[k].to(dtype)).float().mean() <= 0.005, k
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-4)  # fp32 sums, other order
    xl = x.clone().requires_grad_()
    assert "RMSNormFunction" in type(norm.rms_norm(xl, w, 1e-6).grad_fn).__name__
    mixed = F.rms_norm(x, (384,), w, 1e-6)  # torch's own mixed-dtype path
    ulp = (torch.finfo(dtype).eps * mixed.float().abs()).clamp_min(torch.finfo(dtype).tiny)
    assert ((got[0].float() - mixed.float()).abs() <= 2 * ulp).all()
    assert (got[0] == mixed).float().mean() >= 0.95


def test_second_derivatives_are_torchs():
    g = torch.Generator().manual_seed(4)
    x0, w0 = torch.randn(3, 37, generator=g), torch.rand(37, generator=g) + 0.5
    go, v = torch.randn(3, 37, generator=g), torch.randn(3, 37, generator=g)
    results = []
    for fn in (lambda a, b: norm.rms_norm(a, b, 1e-6), lambda a, b: F.rms_norm(a, (37,), b, 1e-6)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        dx, dw = torch.autograd.grad(fn(x, w), (x, w), go, create_graph=True)
        hx, hw = torch.autograd.grad((dx * v).sum() + dw.sum(), (x, w))  # Hessian-vector terms
        results.append([dx, dw, hx, hw])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_module_is_torch_rmsnorm():
    torch.manual_seed(3)
    for shape, affine, eps in (((384,), True, None), ((6, 64), True, 1e-6), ((37,), False, 1e-5)):
        ref = torch.nn.RMSNorm(shape, eps=eps, elementwise_affine=affine)
        fused = norm.FusedRMSNorm(shape, eps=eps, elementwise_affine=affine)
        assert fused.extra_repr() == ref.extra_repr()
        assert list(fused.state_dict()) == list(ref.state_dict())
        for a, b in zip(fused.state_dict().values(), ref.state_dict().values()):
            assert torch.equal(a, b)  # same init
        if affine:
            with torch.no_grad():
                ref.weight.uniform_(0.5, 1.5)
            fused.load_state_dict(ref.state_dict())
            ref.load_state_dict(fused.state_dict())
        x = torch.randn(9, *shape)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        out1, out2 = fused(x1), ref(x2)
        go = torch.randn_like(out1)
        out1.backward(go)
        out2.backward(go)
        torch.testing.assert_close(out1, out2, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
        if affine:
            assert "RMSNormFunction" in type(out1.grad_fn).__name__ or len(shape) > 1
            torch.testing.assert_close(fused.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)


def test_fake_kernels_pass_opcheck():
    x, w = torch.randn(4, 3, 37), torch.rand(37)
    out, rstd = torch.ops.hybridrl.rms_norm_fwd(x, w, 1e-6)
    torch.library.opcheck(torch.ops.hybridrl.rms_norm_fwd, (x, w, 1e-6),
                          test_utils=("test_schema", "test_faketensor"))
    for weight in (w, None):
        torch.library.opcheck(torch.ops.hybridrl.rms_norm_bwd, (torch.randn_like(x), x, rstd, weight),
                              test_utils=("test_schema", "test_faketensor"))


def test_traces_under_torch_compile():
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    x0, w0 = torch.randn(8, 3, 37), torch.rand(37) + 0.5
    compiled = torch.compile(lambda a, b: norm.rms_norm(a, b, 1e-6), fullgraph=True,
                             backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    got = _grads(compiled, x0, w0, torch.ones_like(x0))
    want = _grads(lambda a, b: F.rms_norm(a, (37,), b, 1e-6), x0, w0, torch.ones_like(x0))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(graphs) == 2 and "hybridrl.rms_norm_fwd" in graphs[0]
    assert "hybridrl.rms_norm_bwd" in graphs[1]
