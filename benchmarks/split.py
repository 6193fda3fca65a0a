"""Colocated vs split placement with one-step off-policy rollouts, same job, same ranks, one run.

    .venv/bin/python benchmarks/split.py [--steps 8] [--warmup 2] [key=value overrides ...]

Two gloo ranks (one core each on an idle machine) run the same PPO job (``configs/demo_cpu.yaml``,
GRPO, builtin engine, plus ``JOB`` and the overrides), one after the other in one process group:
- colocated: both ranks generate (2 gen replicas, each half of the batch), then both train (dp 2);
- split + async: rank 1 generates the whole batch (``parallel.placement=split``,
  ``parallel.gen.world=1``) one step ahead (``rollout.async_steps=1``) while rank 0 trains on
  the whole batch (dp 1);
- split, async 0: the same placement without the overlap (where the gain comes from).
For each it prints the mean over the steps after ``--warmup`` of the step time, every
``timing_s/*`` phase, and for split the generation time on the generation rank
(``timing_s/gen_busy``) and the overlap fraction (``timing_s/overlap`` / ``gen_busy``: the share
of generation hidden behind training); then the settings and the ratio split+async /
colocated seconds per step. The issue's goal is <= 0.7. ``uptime`` is printed before and after:
timings on a shared 2-core machine move with the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridrl.testing.dist import run_on_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo_cpu.yaml")
# a job whose generation is a real share of the step: 16-token responses, one mini-batch
JOB = ["rollout.response_length=16", "model.max_position_embeddings=128",
       "data.train_batch_size=8", "rollout.n=8", "actor.ppo_mini_batch_size=8",
       "actor.ppo_micro_batch_size_per_gpu=8", "ref.log_prob_micro_batch_size_per_gpu=16",
       "trainer.kl_guard.max_kl=0"]
SIDES = {"colocated": [],
         "split+async": ["parallel.placement=split", "parallel.gen.world=1",
                         "rollout.async_steps=1"],
         "split": ["parallel.placement=split", "parallel.gen.world=1"]}


def _run(rank: int, world: int, steps: int, overrides: list[str], tmp: str) -> dict:
    import warnings

    import torch

    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.train import build_layout
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.split_run import fit_split

    warnings.filterwarnings("ignore")
    out = {}
    for side, extra in SIDES.items():
        cfg = load_config([DEMO], [
            *JOB, f"trainer.total_steps={steps}", "trainer.save_freq=-1",
            "trainer.test_freq=-1", "trainer.logger=[console]", f"trainer.output_dir={tmp}",
            f"trainer.experiment_name={side}", f"data.synthetic.dir={tmp}/data", *overrides,
            *extra], world_size=world)
        train, gen = build_layout(cfg, world)
        torch.manual_seed(cfg.trainer.seed)
        quiet = lambda *a, **k: None  # noqa: E731
        if cfg.parallel.split:
            out[side] = fit_split(cfg, train, cfg.trainer.collective_timeout_s, print_fn=quiet)
        else:
            out[side] = PPOTrainer(cfg, build_groups(train, gen), print_fn=quiet).fit()
    return out


def _mean(hist: list[dict], key: str, warmup: int) -> float:
    vals = [m[key] for m in hist[warmup:] if key in m]
    return statistics.fmean(vals) if vals else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    print("uptime before:", os.popen("uptime").read().strip(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        res = run_on_ranks(_run, 2, args.steps, args.overrides, tmp, timeout=3000,
                           preload=("megatron.core",))[0]
    print("uptime after: ", os.popen("uptime").read().strip())
    print(f"job: configs/demo_cpu.yaml {' '.join(JOB + args.overrides)}; 2 ranks; "
          f"{args.steps} steps, mean of steps {args.warmup + 1}..{args.steps}")
    phases = ["step", "gen", "gen_wait", "reshard", "old_log_prob", "ref", "reward", "adv",
              "update_actor", "gen_busy", "overlap"]
    print(f"{'side':<12} " + " ".join(f"{p:>12}" for p in phases) + f" {'overlap %':>9}")
    step = {}
    for side, hist in res.items():
        row = {p: _mean(hist, f"timing_s/{p}", args.warmup) for p in phases}
        step[side] = row["step"]
        frac = row["overlap"] / row["gen_busy"] if row["gen_busy"] == row["gen_busy"] else 0.0
        print(f"{side:<12} " + " ".join(f"{row[p]:>12.3f}" for p in phases)
              + f" {100 * frac:>8.0f}%")
    ratio = step["split+async"] / step["colocated"]
    print(f"seconds per step: colocated {step['colocated']:.3f}, split+async "
          f"{step['split+async']:.3f}, split (async 0) {step['split']:.3f}; split+async / "
          f"colocated = {ratio:.2f} (goal <= 0.70: {'met' if ratio <= 0.7 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
