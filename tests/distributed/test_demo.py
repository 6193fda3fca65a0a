"""A shorter ``make demo`` (hybridrl.demo) on 4 gloo ranks: tp 2 x pp 2 training, gen tp 1 (the
reshard moves bytes), SFT warm start, then PPO with a critic and a KL loss; the held-out greedy
score after RL beats the SFT checkpoint's, and the metrics file and the plot are written."""

from __future__ import annotations

import os

import pytest

from hybridrl.testing.dist import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["sft.total_steps=100", "trainer.total_steps=20", "trainer.test_freq=10"]


def demo_rank(rank: int, world: int, root: str) -> tuple:
    from hybridrl.config.loader import load_config
    from hybridrl.demo import run_demo
    from hybridrl.parallel.groups import build_groups
    from hybridrl.train import build_layout

    overrides = SHORT + [f"data.synthetic.dir={root}/data", f"sft.output_dir={root}/sft",
                         f"trainer.output_dir={root}"]

    def load(extra):
        return load_config([os.path.join(REPO, "configs", "demo.yaml")], overrides + extra)

    train, gen = build_layout(load([]), world)
    return run_demo(load, build_groups(train, gen), print_fn=lambda *a, **k: None)


def test_short_demo_rl_beats_sft(tmp_path):
    sft, rl, metrics, plot = run_on_ranks(demo_rank, 4, str(tmp_path), timeout=900)[0]
    assert rl > sft, (sft, rl)
    assert os.path.getsize(metrics) > 0
    if plot == "none":
        pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    assert os.path.getsize(plot) > 0
