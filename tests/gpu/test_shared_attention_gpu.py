"""Shared-prompt attention on CUDA (skipped without CUDA; hybridrl.models, no megatron): the grouped
path's ``causal_lower_right`` bias runs in SDPA's flash kernel with GQA in bf16 (the math kernel
is disabled for the call, so a fallback to it fails the test) and equals the fp32 CPU result,
forward and the gradients of q/k/v, within bf16 tolerance."""

from __future__ import annotations

import pytest
import torch

from hybridrl.models import packing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_grouped_shared_attention_runs_flash_with_gqa_and_matches_cpu():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    lens, parents = [64, 40, 17, 33, 9, 50], [-1, 0, 0, 0, -1, 4]  # two groups, GQA 8 / 2
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    S, D = int(cu[-1]), 64
    q, k, v = (torch.randn(1, heads, S, D) for heads in (8, 2, 2))
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_ref = packing.shared_attention(*ref, cu, parents, D ** -0.5, path="grouped")
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    dev = [t.to("cuda", torch.bfloat16).requires_grad_(True) for t in (q, k, v)]
    plan = packing.shared_plan(cu, parents, torch.device("cuda"))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # the roots' causal calls are flash too
        out = packing.shared_attention(*dev, cu, parents, D ** -0.5, path="grouped", plan=plan)
        out.backward(grad.to("cuda", torch.bfloat16))
    assert (out.float().cpu() - out_ref.detach()).abs().max() < 3e-2
    for a, b in zip(dev, ref):
        assert (a.grad.float().cpu() - b.grad).abs().max() < 5e-2
