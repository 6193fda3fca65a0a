"""examples/torch_loop_losses.py: a plain torch loop on hybridrl's GRPO advantages, PPO loss and
fused low_var_kl learns its counting task (reward from chance to near 1), reproducibly."""

from tests.support.examples import load_example


def test_plain_torch_loop_learns_with_hybridrl_losses():
    example = load_example("torch_loop_losses")
    rewards = example.main(steps=40)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.4 and last > 0.8, (first, last)
    assert example.main(steps=3) == rewards[:3]  # seeded: the same run twice


def test_without_advantage_signal_nothing_is_learned():
    """The learning comes from the advantages: with lr 0 the reward stays at chance."""
    rewards = load_example("torch_loop_losses").main(steps=20, lr=0.0)
    assert sum(rewards[-5:]) / 5 < 0.4
