"""KL controllers (hand-computed and random sequences, checkpoints) and the in-reward KL."""

import numpy as np
import pytest
import torch

from hybridrl.algos.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
)


def test_adaptive_hand_sequence():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    values = []
    for kl in (0.1, 0.05, 0.0, 0.055):
        ctrl.update(kl, n_steps=10)
        values.append(ctrl.value)
    # kl 0.1:   err = clip(0.1/0.05 - 1 = 1, +-0.2) = 0.2  -> x(1 + 0.2*10/100) = 0.102
    # kl 0.05:  err 0                                      -> 0.102
    # kl 0.0:   err = clip(-1) = -0.2                      -> 0.102 * 0.98 = 0.09996
    # kl 0.055: err 0.1                                    -> 0.09996 * 1.01 = 0.1009596
    assert values == pytest.approx([0.102, 0.102, 0.09996, 0.1009596], rel=1e-12)


def test_adaptive_random_sequence_vs_numpy_and_checkpoint():
    rng = np.random.default_rng(0)
    kls = rng.uniform(0.0, 0.3, size=30)
    steps = rng.integers(1, 64, size=30)
    ctrl = AdaptiveKLController(0.2, target_kl=0.1, horizon=500)
    ref = 0.2
    resumed = None
    for i, (kl, n) in enumerate(zip(kls, steps)):
        ref *= 1 + np.clip(kl / 0.1 - 1, -0.2, 0.2) * n / 500
        ctrl.update(float(kl), int(n))
        if resumed is not None:
            resumed.update(float(kl), int(n))
        if i == 10:  # checkpoint, then continue on a fresh controller built with other settings
            resumed = AdaptiveKLController(1.0, target_kl=9.0, horizon=1)
            resumed.load_state_dict(ctrl.state_dict())
        assert ctrl.value == pytest.approx(ref, rel=1e-12)
    assert resumed.value == ctrl.value


def test_fixed_controller_and_builder():
    ctrl = build_kl_controller("fixed", kl_coef=0.3)
    ctrl.update(5.0, n_steps=100)
    assert isinstance(ctrl, FixedKLController) and ctrl.value == 0.3
    other = FixedKLController(0.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.3
    adaptive = build_kl_controller("adaptive", kl_coef=0.3, target_kl=0.1, horizon=10)
    assert isinstance(adaptive, AdaptiveKLController)
    with pytest.raises(ValueError, match=r"kl_ctrl.type must be one of \['fixed', 'adaptive'\]"):
        build_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="target_kl"):
        build_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-1.0)


def _reference_kl(old, ref, kind):
    d = old - ref
    if kind == "kl":
        return d
    x = torch.clamp(-d, -20, 20)  # low_var_kl
    return torch.clamp(torch.exp(x) - x - 1, -10, 10)


@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
def test_apply_kl_in_reward_vs_reference(kind):
    g = torch.Generator().manual_seed(1)
    B, T = 6, 5
    scores = torch.zeros(B, T, dtype=torch.float64)
    scores[:, -1] = torch.rand(B, generator=g, dtype=torch.float64)
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.8).double()
    mask[:, 0] = 1.0
    ctrl = AdaptiveKLController(0.05, target_kl=0.01, horizon=1000)
    rewards, metrics = apply_kl_in_reward(scores, old, ref, mask, ctrl, kl_penalty=kind)

    kl = _reference_kl(old, ref, kind) * mask
    torch.testing.assert_close(rewards, scores - 0.05 * kl)  # beta read before the update
    # verl's masked mean divides by (token count + 1e-8)
    per_seq = [float(kl[b][mask[b] > 0].sum()) / (float(mask[b].sum()) + 1e-8) for b in range(B)]
    current = sum(per_seq) / B
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current, rel=1e-10)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.05
    expected_beta = 0.05 * (1 + np.clip(current / 0.01 - 1, -0.2, 0.2) * B / 1000)
    assert ctrl.value == pytest.approx(expected_beta, rel=1e-12)
