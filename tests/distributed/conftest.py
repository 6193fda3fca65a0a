"""Fixtures shared by distributed test files.

``demo_sft``: one SFT warm start of the demo's model (configs/demo.yaml, 200 SFT steps, tp 2 on 2
gloo ranks), made once per session and shared by the two demo tests (``test_demo``: PPO on tp 2
x pp 2; ``test_demo_async``: split placement). The export is HF files, so each test's PPO run
loads it on its own layout. Returns ``{"root", "score", "folder"}``: the folder holding
``data/`` (the synthetic task) and ``sft/`` (``generations.jsonl``, ``metrics.jsonl``, ``hf/``),
the SFT model's held-out greedy score and its HF export.
"""

from __future__ import annotations

import os

import pytest

from hybridrl.testing.dist import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_SFT = ["sft.total_steps=200", "parallel.pp=1"]


def demo_overrides(root: str) -> list[str]:
    """Where the demo tests' data, SFT export and run folders live."""
    return [f"data.synthetic.dir={root}/data", f"sft.output_dir={root}/sft",
            f"trainer.output_dir={root}"]


def demo_sft_rank(rank: int, world: int, root: str) -> tuple[float, str]:
    import warnings

    from hybridrl.config.loader import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.sft import run_sft
    from hybridrl.train import build_layout

    warnings.filterwarnings("ignore")
    cfg = load_config([os.path.join(REPO, "configs", "demo.yaml")],
                      DEMO_SFT + demo_overrides(root))
    train, gen = build_layout(cfg, world)
    history, folder = run_sft(cfg, build_groups(train, gen), print_fn=lambda *a, **k: None)
    return history[-1]["val/score/mean"], folder


@pytest.fixture(scope="session")
def demo_sft(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("demo_sft"))
    score, folder = run_on_ranks(demo_sft_rank, 2, root, timeout=900,
                                 preload=("megatron.core",))[0]
    return {"root": root, "score": score, "folder": folder}
