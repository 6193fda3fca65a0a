"""End-to-end PPO throughput on CPU gloo ranks: where a step's time goes, per reshard strategy.

    .venv/bin/python benchmarks/throughput.py [--world 2] [--steps 10] [--warmup 2]
        [--strategies zero_redundancy,allgather] [key=value overrides ...]

The PPO loop of ``configs/demo_cpu.yaml`` (GRPO, builtin engine) plus the overrides runs on
``--world`` gloo ranks in one process group, once per reshard strategy, on the same data with
the same seed; the default layout is train tp = 2 with gen tp = 1 (the HybridFlow micro-DP case:
each rank holds half of every layer and the generation needs all of it). For each strategy it
prints the mean over the steps after ``--warmup`` of: the step time, tokens per second (prompt +
response tokens of the whole batch / step time), every ``timing_s/*`` phase and its share of the
step, so the reshard's overhead on a real step is its ``reshard`` share. Then, both sides in the
same run: each strategy's step and reshard time against the first strategy's, as ratios.
Timings on a shared 2-core machine move by tens of percent between runs; compare within a run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridrl.testing.dist import run_on_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo_cpu.yaml")
LAYOUT = ["parallel.tp=2", "parallel.gen.tp=1"]


def _run(rank: int, world: int, strategies: list[str], steps: int, overrides: list[str],
         tmp: str) -> dict:
    """Train ``steps`` steps per strategy on this rank; {strategy: per-step metrics}."""
    import warnings

    import torch

    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.train import build_layout
    from hybridrl.trainer.ppo import PPOTrainer

    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's apex/TE/CUDA notices
    out = {}
    for strategy in strategies:
        cfg = load_config([DEMO], [
            *LAYOUT, f"trainer.total_steps={steps}", "trainer.save_freq=-1",
            "trainer.test_freq=-1", "trainer.logger=[console]",
            f"trainer.output_dir={tmp}", f"trainer.experiment_name={strategy}",
            f"data.synthetic.dir={tmp}/data",
            *overrides, f"reshard.strategy={strategy}"])
        cfg.check_world(world)
        train, gen = build_layout(cfg, world)
        torch.manual_seed(cfg.trainer.seed)
        trainer = PPOTrainer(cfg, build_groups(train, gen), print_fn=lambda *a, **k: None)
        out[strategy] = trainer.fit()
    return out


def _summary(history: list[dict], warmup: int, world: int) -> dict:
    kept = history[warmup:] or history
    keys = sorted({k for m in kept for k in m if k.startswith("timing_s/")})
    mean = {k: statistics.mean(m[k] for m in kept) for k in keys}
    mean["tokens_per_s"] = statistics.mean(m["perf/throughput"] for m in kept) * world
    return mean


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    parser.add_argument("--strategies", default="zero_redundancy,allgather")
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = parser.parse_args(argv)
    strategies = args.strategies.split(",")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    with tempfile.TemporaryDirectory() as tmp:
        res = run_on_ranks(_run, args.world, strategies, args.steps, args.overrides, tmp,
                           timeout=3600, preload=("megatron.core",))[0]
    print(f"world {args.world}, {' '.join(LAYOUT + args.overrides)}, {args.steps} steps "
          f"(means over the last {args.steps - args.warmup})")
    sums = {s: _summary(res[s], args.warmup, args.world) for s in strategies}
    phases = [k for k in sums[strategies[0]] if k.startswith("timing_s/") and k != "timing_s/step"]
    for s in strategies:
        m = sums[s]
        step = m["timing_s/step"]
        reshard = m["timing_s/reshard"]
        print(f"{s:<16} step {step * 1e3:8.1f} ms   {m['tokens_per_s']:8.1f} tokens/s   "
              f"reshard {reshard * 1e3:7.2f} ms = {100 * reshard / step:5.2f}% of the step")
        print("    " + "  ".join(f"{k[9:]} {m[k] * 1e3:.1f} ms ({100 * m[k] / step:.0f}%)"
                                 for k in phases))
    first = sums[strategies[0]]
    for s in strategies[1:]:
        m = sums[s]
        print(f"{s} / {strategies[0]}: step x{m['timing_s/step'] / first['timing_s/step']:.3f}, "
              f"reshard x{m['timing_s/reshard'] / max(first['timing_s/reshard'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
