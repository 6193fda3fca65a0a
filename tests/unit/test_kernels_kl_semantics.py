"""Compiled KL ops (CPU): second derivatives and the straight-through ("+") values, as verl.

- kl_backward has an autograd kernel: gradgradcheck passes in fp64, and Hessian-vector products
  (create_graph=True) of every kind, "+" kinds included, equal the reference's; so does a third
  derivative of k3.
- "+" kinds: the value is verl's ``b - b.detach() + f.detach()`` (b = k2): NaN where 0.5 d^2 is
  not finite (infinite inputs), f elsewhere, in the math dtype (fp32 for bf16/fp16: the
  documented difference from an eager fp16 reference, whose 0.5 d^2 overflows at |d| >= 256).
- The ops reject a bwd_kind that is neither fwd_kind nor k2 and a straight-through code given
  to kl_backward.
"""

import pytest
import torch

import hybridrl.kernels as K
from hybridrl.kernels import ops
from hybridrl.kernels import reference as ref

pytestmark = pytest.mark.skipif(not ops.compiled_available("kl_forward", "cpu"),
                                reason="hybridrl._C not built (pip install --no-build-isolation -e .)")

PLUS = ["k1+", "abs+", "k3+", "low_var_kl+"]


def _inputs(n, seed, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    rl = lp + torch.randn(n, generator=g, dtype=torch.float64) * scale
    return lp.to(dtype), rl.to(dtype)


@pytest.mark.parametrize("kind", ["abs", "k2", "k3"])
def test_kl_gradgradcheck(kind):
    lp, rl = _inputs(12, seed=1)
    a, b = lp.requires_grad_(), rl.requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x, y: K.kl_penalty(x, y, kind), (a, b))


def _hvp(fn, lp, rl, kind, weights):
    """Second-order terms of sum(w * kl): d/d(lp, ref) of ||d(kl)/d lp||^2 + 3 sum d(kl)/d ref."""
    a, b = lp.clone().requires_grad_(), rl.clone().requires_grad_()
    ga, gb = torch.autograd.grad((fn(a, b, kind) * weights).sum(), (a, b), create_graph=True)
    return torch.autograd.grad((ga * ga).sum() + 3 * gb.sum(), (a, b))


@pytest.mark.parametrize("kind", ["k2", "k3", "low_var_kl"] + PLUS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_double_backward_matches_reference(kind, dtype):
    lp, rl = _inputs(2000, seed=2, dtype=dtype, scale=8.0)  # both sides of every clamp
    lp[:3] = torch.tensor([0.0, 0.0, 1.0], dtype=dtype)
    rl[:3] = torch.tensor([20.0, -20.0, 1.0], dtype=dtype)  # clamp edges and d = 0
    w = torch.linspace(-1, 2, 2000, dtype=dtype)
    got = _hvp(K.kl_penalty, lp, rl, kind, w)
    want = _hvp(ref.kl_penalty_ref, lp, rl, kind, w)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for g, x in zip(got, want):
        torch.testing.assert_close(g, x, rtol=tol, atol=tol)
        assert x.abs().sum() > 0  # a real second-order term, not zeros on both sides


def test_kl_third_derivative_of_k3_matches_reference():
    lp, rl = _inputs(50, seed=3)

    def third(fn):
        a = lp.clone().requires_grad_()
        (g1,) = torch.autograd.grad(fn(a, rl, "k3").sum(), a, create_graph=True)
        (g2,) = torch.autograd.grad(g1.sum(), a, create_graph=True)
        return torch.autograd.grad(g2.sum(), a)[0]

    torch.testing.assert_close(third(K.kl_penalty), third(ref.kl_penalty_ref))


@pytest.mark.parametrize("kind", PLUS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_straight_through_value_is_nan_where_verls_is(kind, dtype):
    inf, nan = float("inf"), float("nan")
    lp = torch.tensor([inf, -inf, 0.0, -1.0, nan, -1e30, -3.0, 0.0], dtype=dtype)
    rl = torch.tensor([0.0, 0.0, inf, -1.0, 0.0, 0.0, -1.0, -25.0], dtype=dtype)
    got = K.kl_penalty(lp, rl, kind)
    want = ref.kl_penalty_ref(lp, rl, kind)
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    assert got[:2].isnan().all()  # the plain estimator is finite (k3: 10) or inf there
    torch.testing.assert_close(got[~want.isnan()], want[~want.isnan()], rtol=1e-6, atol=1e-6)
    lp_g = lp[2:4].clone().requires_grad_()  # the gradient stays k2's
    K.kl_penalty(lp_g, rl[2:4], kind).sum().backward()
    torch.testing.assert_close(lp_g.grad, (lp[2:4] - rl[2:4]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_straight_through_low_precision_follows_the_fp32_reference(dtype):
    lp = torch.tensor([300.0, -300.0, 100.0, float("inf")], dtype=dtype)
    rl = torch.zeros(4, dtype=dtype)
    got = K.kl_penalty(lp, rl, "k3+")
    want32 = ref.kl_penalty_ref(lp.float(), rl.float(), "k3+").to(dtype)
    torch.testing.assert_close(got, want32, equal_nan=True)
    assert got[:3].isfinite().all() and got[3].isnan()
    if dtype == torch.float16:  # eager fp16: 0.5 d^2 overflows at |d| >= 256 -> NaN (documented)
        assert ref.kl_penalty_ref(lp, rl, "k3+")[:2].isnan().all()


def test_kl_ops_reject_inconsistent_kinds():
    lp, rl = _inputs(4, seed=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="bwd_kind"):
        torch.ops.hybridrl.kl_forward(lp, rl, ref.KL_K3, ref.KL_K1)
    with pytest.raises(ValueError, match="bwd_kind"):
        torch.ops.hybridrl.kl_backward(torch.ones_like(lp), lp, rl, 4 | ref.KL_K3)
    with pytest.raises(ValueError, match="fwd_kind"):
        torch.ops.hybridrl.kl_forward(lp, rl, 7, ref.KL_K2)


def test_opcheck_kl_backward_autograd_registration():
    lp, rl = _inputs(30, seed=5, dtype=torch.float32)
    grad = torch.randn(30)
    for code in (ref.KL_ABS, ref.KL_K2, ref.KL_K3):
        torch.library.opcheck(torch.ops.hybridrl.kl_backward.default,
                              (grad.requires_grad_(), lp.requires_grad_(), rl, code))
