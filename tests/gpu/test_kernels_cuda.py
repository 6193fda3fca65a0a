"""CUDA kernels of hybridrl::* against the references and the GAE emulation (skipped without CUDA).

On a CUDA machine the extension hybridrl._C_cuda must be built: a missing CUDA kernel fails here
instead of silently testing the reference against itself. Every test runs under a watchdog
(faulthandler, ``_WATCHDOG_S``): a hung kernel dumps the stack and ends the process instead of
stalling the run. What is checked:
- GAE: the launch plan the kernel uses equals the emulation's; outputs equal the NumPy emulation
  of the kernel bit for bit (fp32, fp64, and fp16/bf16 as one rounding of the fp32 math) on every
  launch shape, T at segment boundaries, rows past B; the 4096 x 8192 benchmark size against the
  fp64 loop; bool/int/fractional masks and non-contiguous inputs through the public op.
- KL: every kind and dtype through the op itself (k1 too: ``kl_penalty`` computes it eagerly),
  tensors several grid passes long, odd tails, misaligned storage, the "+" kinds' NaN where
  verl's has it, double backward, 4096 x 8192; ``kl_penalty`` equals the op for every kind.
- Whitening: values and errors, the 4096 x 8192 size.
- Streams and graphs: all ops on a non-default stream and captured into a CUDA graph (a launch
  on the wrong stream or a host sync fails the capture); replays with new inputs match eager.
"""

import faulthandler

import numpy as np
import pytest
import torch

import hybridrl.kernels as K
from hybridrl.kernels import ops
from hybridrl.kernels import reference as ref
from tests.unit.gae_cuda_emulation import emulate_gae_kernel, plan_gae

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: the CUDA kernels run only on a GPU")

_WATCHDOG_S = 120
KINDS = ["k1", "abs", "k2", "k3", "k1+", "abs+", "k3+"]


@pytest.fixture(autouse=True)
def _watchdog():
    faulthandler.dump_traceback_later(_WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _require_ops():
    for op in ops.OP_NAMES:
        assert ops.compiled_available(op, "cuda"), f"hybridrl::{op} has no CUDA kernel (build)"


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


# ---- GAE ------------------------------------------------------------------------------------


def _gae_np(B, T, seed, frac=False):
    g = np.random.default_rng(seed)
    r, v = g.standard_normal((B, T)), g.standard_normal((B, T))
    m = g.random((B, T)) if frac else (g.random((B, T)) > 0.3).astype(np.float64)
    if B > 2:
        m[0] = 0.0
        m[1] = 1.0
        m[2, T // 3: 2 * T // 3] = 0.0  # a hole across warps (and segments when T is long)
    return r, v, m


def test_gae_plan_matches_emulation():
    _require_ops()
    from hybridrl import _C_cuda

    for acc_bytes in (4, 8):
        for B in (1, 5, 300, 4096):
            for T in (1, 100, 127, 128, 129, 512, 1000, 1025, 2048, 2049, 3000, 8192, 20000):
                assert _C_cuda.gae_plan(B, T, acc_bytes, _sms()) == plan_gae(B, T, acc_bytes,
                                                                             _sms()), (B, T)


GAE_SHAPES = [(1, 1), (3, 2), (5, 127), (9, 128), (7, 129), (5, 511), (17, 1000), (3, 1024),
              (6, 2047), (4, 2048), (6, 2049), (3, 5000), (600, 100), (2, 20000)]


@pytest.mark.parametrize("B,T", GAE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae_bit_exact_with_emulation(B, T, dtype):
    _require_ops()
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    r, v, m = (a.astype(np_dtype) for a in _gae_np(B, T, seed=B + T, frac=T % 2 == 1))
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95)]:
        want = emulate_gae_kernel(r, v, m, gamma, lam, sms=_sms())
        got = K.gae(*(torch.from_numpy(a).cuda() for a in (r, v, m)), gamma, lam)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.cpu().numpy(), w)
        loop = ref.gae_ref(*(torch.from_numpy(a).double() for a in (r, v, m)), gamma, lam)
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(got[0].cpu().double(), loop[0], rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gae_low_precision_is_one_rounding_of_the_emulated_fp32_math(dtype):
    _require_ops()
    for B, T in [(7, 300), (5, 2049)]:
        r, v, m = (torch.from_numpy(a).to(dtype) for a in _gae_np(B, T, seed=T))
        want = emulate_gae_kernel(*(a.float().numpy() for a in (r, v, m)), 0.99, 0.95,
                                  sms=_sms())
        got = K.gae(r.cuda(), v.cuda(), m.cuda(), 0.99, 0.95)
        for g, w in zip(got, want):
            assert g.dtype == dtype
            assert torch.equal(g.cpu(), torch.from_numpy(w).to(dtype))


def test_gae_masks_and_noncontiguous_inputs_through_the_public_op():
    _require_ops()
    r, v, m = (torch.from_numpy(a).float() for a in _gae_np(40, 700, seed=3))
    want = ref.gae_ref(r.double(), v.double(), m.double(), 0.99, 0.95)
    for mask in (m.bool(), m.long(), m):
        got = K.gae(r.cuda(), v.cuda(), mask.cuda(), 0.99, 0.95)
        torch.testing.assert_close(got[0].cpu().double(), want[0], rtol=2e-5, atol=2e-4)
    rt, vt, mt = (a.t().contiguous().cuda().t() for a in (r, v, m))  # [40, 700] strided views
    assert not rt.is_contiguous()
    got = K.gae(rt, vt, mt, 0.99, 0.95)
    torch.testing.assert_close(got[1].cpu().double(), want[1], rtol=2e-5, atol=2e-4)
    frac = torch.rand(40, 700)
    got = K.gae(r.cuda(), v.cuda(), frac.cuda(), 0.99, 0.95)
    want = ref.gae_ref(r.double(), v.double(), frac.double(), 0.99, 0.95)
    torch.testing.assert_close(got[0].cpu().double(), want[0], rtol=2e-5, atol=2e-4)


def test_gae_benchmark_size_4096x8192():
    _require_ops()
    g = torch.Generator(device="cuda").manual_seed(0)
    r = torch.randn(4096, 8192, device="cuda", generator=g)
    v = torch.randn(4096, 8192, device="cuda", generator=g)
    lengths = torch.randint(1, 8193, (4096, 1), device="cuda", generator=g)
    m = (torch.arange(8192, device="cuda")[None, :] < lengths).float()
    adv, ret = K.gae(r, v, m, 1.0, 0.95)
    want_adv, want_ret = ref.gae_ref(r.double(), v.double(), m.double(), 1.0, 0.95)
    torch.testing.assert_close(adv.double(), want_adv, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(ret.double(), want_ret, rtol=1e-4, atol=1e-3)


# ---- KL -------------------------------------------------------------------------------------


def _kl_inputs(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    rl = lp + torch.randn(shape, generator=g, dtype=torch.float64) * 3
    edges = [(0.0, 20.0), (0.0, -20.0), (-5.0, 30.0), (1.0, -40.0), (-1.0, -1.0), (-1e3, 0.0)]
    for i, (a, b) in enumerate(edges[: lp.numel()]):
        lp.view(-1)[i], rl.view(-1)[i] = a, b
    return lp.to("cuda", dtype), rl.to("cuda", dtype)


def _op_kl(lp, rl, kind):
    """The CUDA op itself for every kind: ``kl_penalty`` computes k1 eagerly (one subtraction),
    so calling it would compare eager torch with eager torch."""
    return torch.ops.hybridrl.kl_forward(lp, rl, *ref.parse_kl_kind(kind))


def _run(fn, lp, rl, kind, grad_out):
    a, b = lp.clone().requires_grad_(), rl.clone().requires_grad_()
    out = fn(a, b, kind)
    out.backward(grad_out)
    return out.detach(), a.grad, b.grad


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 4099), (3, 1 << 22)])
def test_kl_cuda_fp32(kind, shape):
    # 3 x 2^22 elements: several passes of the grid-stride loop; 7 x 33: a tail of 3
    _require_ops()
    lp, rl = _kl_inputs(shape, seed=shape[1])
    grad_out = torch.randn(shape, device="cuda")
    got = _run(_op_kl, lp, rl, kind, grad_out)
    want = _run(ref.kl_penalty_ref, lp, rl, kind, grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_kl_cuda_other_dtypes(kind, dtype):
    _require_ops()
    lp, rl = _kl_inputs((33, 1001), seed=3, dtype=dtype)  # 33033: a tail for every vector width
    grad_out = torch.randn(33, 1001, device="cuda").to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    got = _run(_op_kl, lp, rl, kind, grad_out)
    want = _run(ref.kl_penalty_ref, lp.to(acc), rl.to(acc), kind, grad_out.to(acc))
    # one rounding of an fp32 result that may differ from torch's in the last fp32 bit: <= 1 ulp
    rtol = {torch.float64: 1e-12, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g, w.to(dtype), rtol=rtol, atol=1e-5)


def test_kl_misaligned_storage_and_direct_ops():
    _require_ops()
    base_lp, base_rl = _kl_inputs((4100,), seed=9)
    lp, rl = base_lp[1:4097], base_rl[2:4098]  # contiguous views 4 and 8 bytes off alignment
    assert lp.data_ptr() % 16 != 0 and rl.data_ptr() % 16 != 0
    grad = torch.randn(4096, device="cuda")
    for code, kind in enumerate(["k1", "abs", "k2", "k3"]):
        out = torch.ops.hybridrl.kl_forward(lp, rl, code, code)
        torch.testing.assert_close(out, ref.kl_penalty_ref(lp, rl, kind), rtol=1e-6, atol=1e-6)
        a = lp.clone().requires_grad_()
        ref.kl_penalty_ref(a, rl, kind).backward(grad)
        got = torch.ops.hybridrl.kl_backward(grad, lp, rl, code)
        torch.testing.assert_close(got, a.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_kl_public_api_equals_the_op(kind):
    # kl_penalty: the op for every kind but k1, which it computes as one eager subtraction
    _require_ops()
    lp, rl = _kl_inputs((5, 999), seed=4)
    torch.testing.assert_close(K.kl_penalty(lp, rl, kind), _op_kl(lp, rl, kind), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_straight_through_nan_like_verl(dtype):
    _require_ops()
    inf, nan = float("inf"), float("nan")
    lp = torch.tensor([inf, -inf, 0.0, -1.0, nan, -3.0, 0.0, 2.0, 1.0], dtype=dtype)
    rl = torch.tensor([0.0, 0.0, inf, -1.0, 0.0, -1.0, -25.0, 1.0, 1.0], dtype=dtype)
    for kind in ["k1+", "abs+", "k3+"]:
        got = K.kl_penalty(lp.cuda(), rl.cuda(), kind).cpu()
        want = ref.kl_penalty_ref(lp.float(), rl.float(), kind).to(dtype)
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-3, atol=1e-6)
        assert got[:2].isnan().all()


@pytest.mark.parametrize("kind", ["k2", "k3", "k3+", "abs+"])
def test_kl_double_backward(kind):
    _require_ops()
    lp, rl = _kl_inputs((64, 257), seed=5, dtype=torch.float64)
    w = torch.randn(64, 257, device="cuda", dtype=torch.float64)

    def hvp(fn):
        a, b = lp.clone().requires_grad_(), rl.clone().requires_grad_()
        ga, gb = torch.autograd.grad((fn(a, b, kind) * w).sum(), (a, b), create_graph=True)
        return torch.autograd.grad((ga * ga).sum() + 3 * gb.sum(), (a, b))

    for g, x in zip(hvp(K.kl_penalty), hvp(ref.kl_penalty_ref)):
        torch.testing.assert_close(g, x, rtol=1e-12, atol=1e-12)
        assert x.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_benchmark_size_4096x8192(dtype):
    _require_ops()
    lp, rl = _kl_inputs((4096, 8192), seed=11, dtype=dtype)  # bf16: ~8 grid-stride passes
    grad_out = torch.randn(4096, 8192, device="cuda").to(dtype)
    rtol, atol = (1e-6, 1e-6) if dtype == torch.float32 else (8e-3, 1e-5)
    for kind in ["k3", "k3+"]:
        got = _run(K.kl_penalty, lp, rl, kind, grad_out)
        want = _run(ref.kl_penalty_ref, lp.float(), rl.float(), kind, grad_out.float())
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w.to(dtype), rtol=rtol, atol=atol)


# ---- whitening ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 1), (17, 33), (512, 4097), (4096, 8192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_whiten_cuda(shape, dtype):
    _require_ops()
    g = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=g) * 5 + 2).to(dtype)
    m = (torch.rand(shape, generator=g) > 0.5).to(dtype)
    m.view(-1)[:2] = 1.0
    got = K.masked_whiten(x.cuda(), m.cuda()).cpu()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, ref.masked_whiten_ref(x, m), rtol=tol, atol=tol)


def test_masked_whiten_errors():
    _require_ops()
    x = torch.randn(5, 7, device="cuda")
    with pytest.raises(ValueError, match="mask"):
        K.masked_whiten(x, torch.zeros_like(x))
    one = torch.zeros_like(x)
    one[2, 3] = 1.0
    with pytest.raises(ValueError, match="mask"):
        K.masked_whiten(x, one)


# ---- streams and CUDA graphs ----------------------------------------------------------------


def _all_ops(lp, rl, r, v, m):
    adv, ret = K.gae(r, v, m, 0.99, 0.95)
    return (K.kl_penalty(lp, rl, "k3"), K.kl_penalty(lp, rl, "k3+"), adv, ret,
            K.masked_whiten(adv, m))


def _fresh_inputs(seed):
    lp, rl = _kl_inputs((33, 1000), seed=seed)
    r, v, m = (torch.from_numpy(a).float().cuda() for a in _gae_np(33, 1000, seed=seed))
    return lp, rl, r, v, m


def test_ops_on_a_non_default_stream():
    _require_ops()
    inputs = _fresh_inputs(1)
    want = _all_ops(*inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = _all_ops(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_ops_capture_into_a_cuda_graph_and_replay():
    _require_ops()
    static = _fresh_inputs(2)
    _all_ops(*static)  # warm-up outside capture (lazy init, caches)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync or a legacy-stream launch would raise here
        outs = _all_ops(*static)
    for seed in (3, 4):
        fresh = _fresh_inputs(seed)
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        for g, w in zip(outs, _all_ops(*fresh)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    zero = torch.zeros(4, 8, device="cuda")  # under capture a mask summing to 0 gives NaN
    x = torch.randn(4, 8, device="cuda")
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        out = torch.ops.hybridrl.masked_whiten(x, zero)
    graph2.replay()
    torch.cuda.synchronize()
    assert out.isnan().all()


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
