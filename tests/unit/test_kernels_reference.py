"""The pure-torch references against independent formulas (so the oracle itself is checked).

- GAE with a full mask equals the closed form adv_t = sum_k (gamma lam)^k delta_{t+k}.
- GAE with holes equals GAE on the row compacted to its valid tokens (holes are skipped).
- masked_whiten with a full mask equals (x - mean) / sqrt(unbiased var + 1e-8).
- "+" estimators keep the base value and take k2's gradient.
"""

import pytest
import torch

from hybridrl.kernels import reference as ref


def _closed_form_gae(r, v, gamma, lam):
    """adv[b, t] = sum_k (gamma lam)^k delta[b, t + k], delta = r + gamma v_{t+1} - v (v_T = 0)."""
    B, T = r.shape
    v_next = torch.cat([v[:, 1:], torch.zeros(B, 1, dtype=v.dtype)], dim=1)
    delta = r + gamma * v_next - v
    k = torch.arange(T, dtype=v.dtype)
    decay = (gamma * lam) ** (k[None, :] - k[:, None])  # [t, s]: (gamma lam)^(s - t)
    weights = torch.triu(decay)  # only s >= t
    return delta @ weights.T


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_ref_full_mask_matches_closed_form(gamma, lam):
    torch.manual_seed(0)
    r, v = torch.randn(5, 17, dtype=torch.float64), torch.randn(5, 17, dtype=torch.float64)
    adv, ret = ref.gae_ref(r, v, torch.ones_like(v), gamma, lam)
    torch.testing.assert_close(adv, _closed_form_gae(r, v, gamma, lam))
    torch.testing.assert_close(ret, adv + v)


def test_gae_ref_holes_are_skipped():
    torch.manual_seed(1)
    r, v = torch.randn(4, 23, dtype=torch.float64), torch.randn(4, 23, dtype=torch.float64)
    mask = (torch.rand(4, 23) > 0.4).to(torch.float64)
    mask[0] = 0.0  # a fully masked row: advantages stay 0
    adv, _ = ref.gae_ref(r, v, mask, 0.9, 0.8)
    assert torch.all(adv[0] == 0)
    for b in range(1, 4):
        keep = mask[b].bool()
        compact = _closed_form_gae(r[b, keep][None], v[b, keep][None], 0.9, 0.8)[0]
        torch.testing.assert_close(adv[b, keep], compact)


def test_masked_whiten_ref_full_mask_is_standardization():
    torch.manual_seed(2)
    x = torch.randn(6, 9, dtype=torch.float64) * 3 + 1
    expected = (x - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(ref.masked_whiten_ref(x, torch.ones_like(x)), expected)


def test_masked_whiten_ref_rejects_degenerate_masks():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="mask"):
        ref.masked_whiten_ref(x, torch.zeros_like(x))
    one = torch.zeros_like(x)
    one[1, 2] = 1
    with pytest.raises(ValueError, match="mask"):
        ref.masked_whiten_ref(x, one)


@pytest.mark.parametrize("base", ["k1", "abs", "k3", "kl", "low_var_kl"])
def test_straight_through_value_and_gradient(base):
    torch.manual_seed(3)
    lp = torch.randn(50, dtype=torch.float64, requires_grad=True)
    rl = torch.randn(50, dtype=torch.float64)
    plus = ref.kl_penalty_ref(lp, rl, base + "+")
    torch.testing.assert_close(plus.detach(), ref.kl_penalty_ref(lp, rl, base).detach())
    (grad_plus,) = torch.autograd.grad(plus.sum(), lp)
    torch.testing.assert_close(grad_plus, (lp - rl).detach())  # d/dlp 0.5 (lp - ref)^2


def test_k3_formula_and_clamps():
    lp = torch.tensor([0.0, 0.0, 0.0, 30.0, -30.0], dtype=torch.float64)
    rl = torch.tensor([0.0, 1.0, -1.0, 0.0, 0.0], dtype=torch.float64)
    kl = torch.clamp(rl - lp, -20, 20)
    expected = torch.clamp(torch.exp(kl) - kl - 1, -10, 10)
    torch.testing.assert_close(ref.kl_penalty_ref(lp, rl, "k3"), expected)
    assert ref.kl_penalty_ref(lp, rl, "k3")[4].item() == pytest.approx(10.0)


@pytest.mark.parametrize("kind", ["k4", "k3++", "", "full", 3])
def test_parse_kl_kind_rejects(kind):
    with pytest.raises(ValueError, match="kind"):
        ref.parse_kl_kind(kind)


@pytest.mark.parametrize("B,T,threads,chunk", [(3, 1, 4, 2), (4, 37, 4, 2), (5, 700, 8, 4),
                                               (2, 2048, 256, 8), (3, 3000, 32, 8)])
def test_chunked_scan_matches_loop(B, T, threads, chunk):
    """The CUDA kernel's algorithm (hybridrl/kernels/scan.py) equals the reference loop."""
    from hybridrl.kernels.scan import gae_chunked_scan

    g = torch.Generator().manual_seed(T)
    r, v = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g,
                                                                            dtype=torch.float64)
    m = (torch.rand(B, T, generator=g) > 0.3).to(torch.float64)
    m[0] = 0.0
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95)]:
        want = ref.gae_ref(r, v, m, gamma, lam)
        got = gae_chunked_scan(r, v, m, gamma, lam, threads=threads, chunk=chunk)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        got32 = gae_chunked_scan(r.float(), v.float(), m.float(), gamma, lam, threads, chunk)
        for a, b in zip(got32, want):
            torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-4)
