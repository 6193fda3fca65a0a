"""``hybridrl plan --time --gpu cpu`` against measured CPU runs: predicted vs measured seconds.

    .venv/bin/python benchmarks/plan_time.py [--steps 5] [--warmup 2] [--only NAME ...]
        [--cached]

Runs the CPU demo job (``configs/demo_cpu.yaml``: GRPO, builtin engine, fp32 tiny llama; the
KL guard off, no checkpoints or validation: the model has no phase for them) in several layouts
on 1-4 gloo ranks, each for ``--steps`` steps, and reads the mean of the steps after
``--warmup`` of ``timing_s/step`` and of every phase the model predicts (gen, reshard,
old_log_prob, ref, update_actor) on rank 0. For each it then runs the planner's prediction
(``hybridrl.planning.timecli.time_report`` with ``--gpu cpu``: this machine's calibration from
``hybridrl plan --calibrate``, measured first unless ``--cached``) on the same
workload: the measured mean prompt and response lengths (``prompt_length/mean``,
``response_length/mean``) and the layout's micro-batches. Prints per case and phase predicted,
measured and predicted / measured; ``other`` is the measured step less the modelled phases
(rewards, advantages, bookkeeping: not in the model); ``cpu/wall`` is rank 0's process CPU time
over its wall time in the measured steps (below 1: waiting for peers, or descheduled by other
work on the machine). ``uptime`` before and after: the machine may be shared; the model knows
its cores (ranks past them share) and calibrates with the load as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.testing.dist import run_on_ranks  # noqa: E402

DEMO = str(ROOT / "configs" / "demo_cpu.yaml")
BASE = ["trainer.kl_guard.max_kl=0", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.logger=[console]"]
CASES = {  # name: (world, overrides)
    "demo_1rank": (1, []),
    "demo_2ranks": (2, []),
    "tp2": (2, ["parallel.tp=2", "parallel.gen.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "resp16_2ranks": (2, ["rollout.response_length=16"]),
    "split_async": (2, ["parallel.placement=split", "parallel.gen.world=1",
                        "rollout.async_steps=1"]),
    "tp2pp2_4ranks": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.gen.tp=2"]),
    "demo_4ranks": (4, []),  # dp 4: more ranks than this machine's 2 cores
}
PHASES = (("generate", "gen"), ("reshard", "reshard"), ("old_log_prob", "old_log_prob"),
          ("reference", "ref"), ("actor_update", "update_actor"))


def _run(rank: int, world: int, steps: int, overrides: list[str], tmp: str) -> list[dict]:
    import warnings

    import torch

    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.train import build_layout
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.split_run import fit_split

    warnings.filterwarnings("ignore")
    cfg = load_config([DEMO], [*BASE, f"trainer.total_steps={steps}",
                               f"trainer.output_dir={tmp}", f"data.synthetic.dir={tmp}/data",
                               *overrides], world_size=world)
    train, gen = build_layout(cfg, world)
    torch.manual_seed(cfg.trainer.seed)
    step = PPOTrainer.train_step

    def timed(self):  # the step's process CPU time next to its wall time
        c0 = time.process_time()
        metrics = step(self)
        return {**metrics, "cpu_s/step": time.process_time() - c0}
    PPOTrainer.train_step = timed
    quiet = lambda *a, **k: None  # noqa: E731
    if cfg.parallel.split:
        return fit_split(cfg, train, cfg.trainer.collective_timeout_s, print_fn=quiet)
    return PPOTrainer(cfg, build_groups(train, gen), print_fn=quiet).fit()


def _mean(hist: list[dict], key: str, warmup: int) -> float:
    vals = [m[key] for m in hist[warmup:] if key in m]
    return statistics.fmean(vals) if vals else 0.0


def _predict(world: int, overrides: list[str], model_json: str, hist: list[dict],
             warmup: int) -> dict:
    from hybridrl.config import load_config
    from hybridrl.planning.cli import _fill, _OneLineParser
    from hybridrl.planning.timecli import time_report

    cfg = load_config([DEMO], [*BASE, *overrides], world_size=world)
    p, r = cfg.parallel, cfg.rollout
    prompt = _mean(hist, "prompt_length/mean", warmup)
    resp = _mean(hist, "response_length/mean", warmup)
    length = math.ceil(prompt + resp)
    micro = cfg.actor.ppo_micro_batch_size_per_gpu
    flags = ["--time", "--model", model_json, "--gpu", "cpu", "--world", str(world),
             "--tp", str(p.tp), "--pp", str(p.pp), "--gen-tp", str(p.gen.tp), "--spec", "local",
             "--engine", "builtin", "--dtype", cfg.model.dtype,
             "--prompts", str(cfg.data.train_batch_size), "--n", str(r.n),
             "--prompt-len", f"{prompt:.3f}", "--response-len", f"{resp:.3f}",
             "--max-response-len", str(r.response_length), "--algo", "grpo",
             "--mini-batches", str(cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size),
             "--max-tokens-per-gpu", str(max(micro * length, math.ceil(prompt)
                                             + r.response_length)),
             "--forward-tokens-per-gpu", str(cfg.ref.log_prob_micro_batch_size_per_gpu
                                             * length),
             "--gpus-per-node", "64"]
    if p.split:
        flags += ["--placement", "split", "--gen-world", str(p.gen.world)]
    parser = _OneLineParser()
    _fill(parser)
    return time_report(parser.parse_args(flags))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", nargs="*", choices=sorted(CASES))
    ap.add_argument("--cached", action="store_true", help="use the cached calibration (default: "
                    "calibrate first, so both sides see the machine as it is now)")
    args = ap.parse_args(argv)
    from hybridrl.config import load_config
    from hybridrl.models.spec import LlamaSpec
    from hybridrl.planning.calibrate import cache_path, run_calibration

    if not args.cached or not os.path.isfile(cache_path()):
        run_calibration()
    print("uptime before:", os.popen("uptime").read().strip(), flush=True)
    cal = json.load(open(cache_path()))
    print(f"calibration ({cache_path()}, {cal['measured_at']}, load {cal['load_avg']:.1f}): "
          f"matmul {cal['flops'] / 1e9:.1f} GFLOP/s, memory {cal['memory_bps'] / 1e9:.1f} GB/s, "
          f"layer call {1e6 * cal['layer_latency_s']:.0f} us (training x "
          f"{cal['train_calls_per_forward']:.2f}), {cal['act_passes']:.1f} activation vectors "
          f"per token and layer (training x {cal['train_act_ratio']:.2f}), optimizer step "
          f"{1e3 * cal['optimizer_latency_s']:.1f} ms, sampling "
          f"{1e6 * cal['sample_latency_s']:.1f} us, gloo collective in the model at tp 2 "
          f"{1e6 * cal['collective_latency_s']:.0f} us (an all-reduce alone: best "
          f"{1e6 * cal['collective_min_s']:.0f} us, after compute "
          f"{1e6 * cal['collective_bench_s']:.0f} us) / {cal['link_bps'] / 1e9:.2f} GB/s, "
          f"dp > 1 optimizer step +{1e3 * cal['dp_step_latency_s']:.1f} ms, "
          f"{cal['cores']} cores; two busy ranks "
          f"{cal['parallel_slowdown']:.2f} x slower each (load; not in the model)")
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_json = os.path.join(tmp, "config.json")
        spec = LlamaSpec.from_model_config(load_config([DEMO]).model)
        with open(model_json, "w") as f:
            json.dump(spec.to_hf_config(), f)
        for name in args.only or CASES:
            world, overrides = CASES[name]
            hist = run_on_ranks(_run, world, args.steps, overrides, f"{tmp}/{name}",
                                timeout=3000, preload=("megatron.core",))[0]
            pred = _predict(world, overrides, model_json, hist, args.warmup)
            measured = {k: _mean(hist, f"timing_s/{m}", args.warmup) for k, m in PHASES}
            step = _mean(hist, "timing_s/step", args.warmup)
            cpu = _mean(hist, "cpu_s/step", args.warmup) / step
            measured["other"] = step - sum(measured.values())
            measured["step"] = step
            predicted = {k: pred["phases_s"][k] for k, _ in PHASES}
            predicted["other"], predicted["step"] = 0.0, pred["step_s"]
            ratios.append(pred["step_s"] / step)
            rows.append((name, world, overrides, predicted, measured, cpu))
            print(f"{name}: predicted {pred['step_s']:.3f} s, measured {step:.3f} s, ratio "
                  f"{pred['step_s'] / step:.2f}; rank 0 on a CPU {100 * cpu:.0f} % of its step",
                  flush=True)
    print("uptime after: ", os.popen("uptime").read().strip())
    print(f"job: configs/demo_cpu.yaml {' '.join(BASE)}; {args.steps} steps, mean of steps "
          f"{args.warmup + 1}..{args.steps}; seconds per step and phase (rank 0)")
    cols = [k for k, _ in PHASES] + ["other", "step"]
    print(f"{'case':<15} {'W':>1} {'side':<9} " + " ".join(f"{c[:12]:>12}" for c in cols)
          + "  cpu/wall")
    for name, world, _, pred, meas, cpu in rows:
        print(f"{name:<15} {world:>1} {'predicted':<9} "
              + " ".join(f"{pred[c]:>12.3f}" for c in cols))
        print(f"{'':<15} {'':>1} {'measured':<9} " + " ".join(f"{meas[c]:>12.3f}" for c in cols)
              + f"  {cpu:8.2f}")
        print(f"{'':<15} {'':>1} {'ratio':<9} " + " ".join(
            f"{pred[c] / meas[c]:>12.2f}" if meas[c] > 1e-4 and c != "other" else f"{'':>12}"
            for c in cols))
    inside = sum(0.75 <= r <= 1.25 for r in ratios)
    print(f"step predicted / measured: {min(ratios):.2f} .. {max(ratios):.2f}; {inside} of "
          f"{len(ratios)} cases within +-25 %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
