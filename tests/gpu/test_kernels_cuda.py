"""CUDA kernels of hybridrl::* against the pure-torch references (skipped without CUDA).

On a CUDA machine the extension hybridrl._C_cuda must be built: a missing CUDA kernel fails here
instead of silently testing the reference against itself. GAE on CUDA runs a chunked parallel
scan (csrc/cuda/gae_cuda.cu), so it matches the sequential reference up to reassociation:
fp64 within 1e-10, fp32 within 1e-5 relative (+1e-4 absolute on advantages of size ~sqrt(T)).
"""

import pytest
import torch

import hybridrl.kernels as K
from hybridrl.kernels import ops
from hybridrl.kernels import reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KINDS = ["k1", "abs", "k2", "k3", "k1+", "abs+", "k3+"]


def _require_ops():
    for op in ops.OP_NAMES:
        assert ops.compiled_available(op, "cuda"), f"hybridrl::{op} has no CUDA kernel (build)"


def _kl_inputs(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    rl = lp + torch.randn(shape, generator=g, dtype=torch.float64) * 3
    edges = [(0.0, 20.0), (0.0, -20.0), (-5.0, 30.0), (1.0, -40.0), (-1.0, -1.0), (-1e3, 0.0)]
    for i, (a, b) in enumerate(edges[: lp.numel()]):
        lp.view(-1)[i], rl.view(-1)[i] = a, b
    return lp.to("cuda", dtype), rl.to("cuda", dtype)


def _run(fn, lp, rl, kind, grad_out):
    a, b = lp.clone().requires_grad_(), rl.clone().requires_grad_()
    out = fn(a, b, kind)
    out.backward(grad_out)
    return out.detach(), a.grad, b.grad


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 4099), (3, 1 << 20)])
def test_kl_cuda_fp32(kind, shape):
    _require_ops()
    lp, rl = _kl_inputs(shape, seed=shape[1])
    grad_out = torch.randn(shape, device="cuda")
    got = _run(K.kl_penalty, lp, rl, kind, grad_out)
    want = _run(ref.kl_penalty_ref, lp, rl, kind, grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_kl_cuda_other_dtypes(dtype):
    _require_ops()
    lp, rl = _kl_inputs((33, 65), seed=3, dtype=dtype)
    grad_out = torch.randn(33, 65, device="cuda").to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    got = _run(K.kl_penalty, lp, rl, "k3", grad_out)
    want = _run(ref.kl_penalty_ref, lp.to(acc), rl.to(acc), "k3", grad_out.to(acc))
    # one rounding of an fp32 result that may differ from torch's in the last fp32 bit: <= 1 ulp
    rtol = {torch.float64: 1e-12, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(dtype), rtol=rtol, atol=1e-5)


def _gae_inputs(B, T, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    m = (torch.rand(B, T, generator=g) > 0.3).float()
    m[0] = 0.0
    if B > 1:
        m[1] = 1.0
    return r.double(), v.double(), m.double(), [t.to("cuda", dtype) for t in (r, v, m)]


@pytest.mark.parametrize("B,T", [(1, 1), (3, 2), (5, 2047), (4, 2048), (6, 2049), (9, 8192),
                                 (2, 20000), (300, 97)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae_cuda_scan_matches_loop(B, T, dtype):
    _require_ops()
    r64, v64, m64, (r, v, m) = _gae_inputs(B, T, seed=B * 7 + T, dtype=dtype)
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95)]:
        adv, ret = K.gae(r, v, m, gamma, lam)
        adv_ref, ret_ref = ref.gae_ref(r64, v64, m64, gamma, lam)
        rtol, atol = (1e-10, 1e-10) if dtype == torch.float64 else (1e-5, 1e-4)
        torch.testing.assert_close(adv.double().cpu(), adv_ref, rtol=rtol, atol=atol)
        torch.testing.assert_close(ret.double().cpu(), ret_ref, rtol=rtol, atol=atol)


def test_gae_cuda_bf16():
    _require_ops()
    r64, v64, m64, (r, v, m) = _gae_inputs(8, 3000, seed=5, dtype=torch.bfloat16)
    adv, _ = K.gae(r, v, m, 0.99, 0.95)
    want = ref.gae_ref(r.double().cpu(), v.double().cpu(), m.double().cpu(), 0.99, 0.95)[0]
    torch.testing.assert_close(adv.double().cpu(), want, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(2, 1), (17, 33), (512, 4097)])
def test_masked_whiten_cuda(shape):
    _require_ops()
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=g) * 5 + 2
    m = (torch.rand(shape, generator=g) > 0.5).float()
    m.view(-1)[:2] = 1.0
    got = K.masked_whiten(x.cuda(), m.cuda()).cpu()
    torch.testing.assert_close(got, ref.masked_whiten_ref(x, m), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mask"):
        K.masked_whiten(x.cuda(), torch.zeros_like(m).cuda())


def test_compile_on_cuda():
    _require_ops()
    torch._dynamo.reset()

    def loss_fn(lp, rl):
        return K.kl_penalty(lp, rl, "k3+").mean()

    lp, rl = _kl_inputs((16, 64), seed=1)
    a, b = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    torch.compile(loss_fn, fullgraph=True)(a, rl).backward()
    ref.kl_penalty_ref(b, rl, "k3+").mean().backward()
    torch.testing.assert_close(a.grad, b.grad)
