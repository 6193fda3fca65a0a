"""The layer kernels (RMSNorm, SwiGLU, RoPE) on a CUDA device: torch's own ops, eager's numbers.

The fused kernels of hybridrl/kernels/norm.py and swiglu.py are CPU ops; on CUDA tensors each
public function must run torch's formula itself (no call into a CPU op, no device error), with
the values and gradients of the eager code it replaces, in fp32 and bf16, and
``FusedRMSNorm`` must be ``torch.nn.RMSNorm`` there (also with the local spec's fp32 weight and
bf16 activations). Skipped without CUDA; scripts/gpu_check.py runs it in its ``tests`` stage.
"""

import pytest
import torch
import torch.nn.functional as F

from hybridrl.kernels.norm import FusedRMSNorm, rms_norm
from hybridrl.kernels.swiglu import apply_rope, swiglu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: the CUDA kernels run only on a GPU")

DTYPES = [torch.float32, torch.bfloat16]


def _leaf(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=g).to(dtype).requires_grad_()


def _grads(out, *leaves):
    g = torch.Generator(device="cuda").manual_seed(99)
    w = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), leaves)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_is_eager_on_cuda(dtype):
    x = _leaf((37, 2 * 96), dtype, 1)
    gate, up = torch.chunk(x, 2, dim=-1)
    want = F.silu(gate) * up
    got = swiglu(x)
    assert got.device.type == "cuda" and got.dtype == dtype
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(_grads(got, x), _grads(want, x), strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope_is_eager_on_cuda(dtype):
    s, d = 23, 64
    qkv = _leaf((s, 2, 3, 4, d), dtype, 2)  # [s, b, groups, heads + 2, d], as the local spec
    x = qkv[:, :, :, :3]  # q heads and the key head: a strided view of the projection
    angle = torch.arange(s, device="cuda").float()[:, None] * torch.rand(d // 2, device="cuda")
    emb = torch.cat([angle, angle], dim=-1)[:, None, None, None]  # [s, 1, 1, 1, d]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    want = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    got = apply_rope(x, cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(_grads(got, qkv)[0], _grads(want, qkv)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", ["same", "fp32"])
def test_rms_norm_is_torchs_on_cuda(dtype, weight_dtype):
    h = 384
    x = _leaf((5, 7, h), dtype, 3)
    wd = dtype if weight_dtype == "same" else torch.float32
    ours, theirs = FusedRMSNorm(h, eps=1e-6).cuda().to(wd), torch.nn.RMSNorm(h, eps=1e-6)
    theirs = theirs.cuda().to(wd)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(h, device="cuda").to(wd) + 0.5)
        theirs.weight.copy_(ours.weight)
    got, want = ours(x), theirs(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(rms_norm(x, ours.weight, 1e-6), want)
    # the weight gradient is a reduction over rows, which a CUDA kernel may order per run
    for a, b in zip(_grads(got, x, ours.weight), _grads(want, x, theirs.weight), strict=True):
        torch.testing.assert_close(a, b)
