"""The CPU demo's loop with issue 30's pieces on one gloo rank (one launch, two runs):
DAPO (algorithm.filter_groups, reward.overlong_buffer, clip-higher, token-mean, rollout IS
per token) and GSPO (policy_loss gspo, reinforce_plus_plus_baseline, rollout IS per sequence,
seq-mean-token-mean). Checked: two steps run, the dynamic-sampling, overlong and rollout-IS
metrics are logged and finite, the IS weights respect the cap, and the weights moved."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hybridrl.testing.dist import run_on_ranks

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml")
COMMON = ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
          "actor.ppo_micro_batch_size_per_gpu=4", "trainer.total_steps=2",
          "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.logger=[console]",
          "algorithm.adv_estimator=grpo"]
RUNS = {
    "dapo": ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=3",
             "reward.overlong_buffer=2", "actor.clip_ratio_high=0.28",
             "actor.loss_agg_mode=token-mean", "actor.rollout_is=token"],
    "gspo": ["actor.policy_loss=gspo", "actor.clip_ratio_low=0.0003",
             "actor.clip_ratio_high=0.0004", "actor.loss_agg_mode=seq-mean-token-mean",
             "algorithm.adv_estimator=reinforce_plus_plus_baseline", "actor.rollout_is=sequence",
             "actor.rollout_is_cap=1.5"],
}


def _rank(rank, world, tmp):
    import warnings

    import torch

    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.train import build_layout
    from hybridrl.trainer.ppo import PPOTrainer

    warnings.filterwarnings("ignore")
    out = {}
    for name, extra in RUNS.items():
        cfg = load_config([DEMO], COMMON + extra + [
            f"trainer.output_dir={tmp}", f"trainer.experiment_name={name}",
            f"data.synthetic.dir={tmp}/data"])
        train, gen = build_layout(cfg, world)
        torch.manual_seed(cfg.trainer.seed)
        tr = PPOTrainer(cfg, build_groups(train, gen), print_fn=lambda *a, **k: None)
        before = {n: p.detach().clone() for n, p in tr.actor.module.named_parameters()}
        hist = tr.fit()
        moved = max(float((p.detach() - before[n]).abs().max())
                    for n, p in tr.actor.module.named_parameters())
        out[name] = {"hist": hist, "moved": moved}
    return out


@pytest.mark.slow
def test_dapo_and_gspo_runs(tmp_path):
    (res,) = run_on_ranks(_rank, 1, str(tmp_path), timeout=600, preload=("megatron.core",))
    dapo, gspo = res["dapo"], res["gspo"]
    for run in (dapo, gspo):
        assert len(run["hist"]) == 2 and run["moved"] > 0
        for step in run["hist"]:
            assert all(math.isfinite(v) for v in step.values() if isinstance(v, float))
            assert 0 < step["rollout_corr/is_mean"] and step["rollout_corr/is_max"] <= (
                2.0 if run is dapo else 1.5) + 1e-6
    for step in dapo["hist"]:
        assert 1 <= step["dynamic_sampling/rounds"] <= 3
        assert "reward/overlong_penalty/mean" in step and step["reward/overlong_penalty/mean"] <= 0
        assert "dynamic_sampling/dropped_frac" in step
    assert all(step["actor/pg_clipfrac_lower"] == 0.0 for step in gspo["hist"])
