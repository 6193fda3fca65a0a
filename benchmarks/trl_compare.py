"""End to end vs TRL: hybridrl GRPO and TRL's GRPOTrainer on the same model, data and batch.

    .venv/bin/python -m pip install trl==1.16.0      # once (not a hybridrl dependency)
    .venv/bin/python benchmarks/trl_compare.py [--worlds 1 2] [--prompts short long realistic]
        [--steps 4] [--rounds 2] [--set KEY=VALUE ...]

Both sides load ONE folder per cell (``benchmarks/trl_model.py``): an HF llama with random
weights from a fixed seed and an HF tokenizer whose ids and chat template are those of hybridrl's
character tokenizer, so both see the same token ids. Cells (``--prompts``): ``short`` and
``long`` use the CPU demo's llama (4 layers, hidden 64, GQA 4/2, vocab 100) and 3 new tokens on
the 100 one-digit ``a+b=`` problems (22 tokens; ``long``: prefixed by an instruction, 68
tokens); ``realistic`` uses a 12.6M llama (8 layers, hidden 384) whose weights make every sampled
token eos with probability 1/30, so response lengths are EOS-driven (geometric, mean ~27 of the
64-token cap) with the same law on both sides. Same settings: 12 prompts x 8 samples per step at
temperature 1, one optimizer step per batch in micro-batches of
4 sequences (the actor update AND the reference forward: TRL runs both at its
per_device_train_batch_size), KL 0.001 (low_var_kl / TRL's k3) against the initial model, lr
3e-3 (``realistic``: 1e-8, so the length law holds over the steps), the GSM8K flexible reward; hybridrl's KL guard off and no per-call reward timeout
(``reward.timeout_s=0``: TRL bounds no reward call either). ``--set`` adds hybridrl config
overrides (to measure one knob). TRL at 2 processes runs under ``torchrun --nproc-per-node 2``
(gloo); hybridrl on 2 gloo ranks (data parallel); one torch thread per process on both sides.

Per (processes, prompt) cell, ``--rounds`` runs of each side, alternating which goes first (the
machine may be shared: the load average is printed per cell); round r samples with seed r + 1
on both sides (``trainer.seed``, TRL's ``seed``), so over rounds each side's response lengths
average over draws of the same law instead of repeating one draw. Seconds per step are the mean over
the steps after the first (warm-up) of each run, as wall time (``wall``) and as the process CPU
time of rank 0 (``cpu``: what the step cost the process, much less sensitive to other jobs on a
shared machine than wall time); for each: the mean over rounds with the range of the round
means and the fastest single step (``min``: the least disturbed one), the ratio TRL / hybridrl of
the means with the range of the per-round ratios and the ratio of the fastest steps; generated
tokens/s (wall),
and where each side's step goes: hybridrl's ``timing_s/*`` phases; TRL's step (a callback around
each optimizer step) split by timers around its ``_generate``, the no-grad
``_get_per_token_logps_and_entropies`` (reference forward), ``_calculate_rewards``, the rest of
``_generate_and_score_completions`` (``score_other``) and the remainder (``update``: the 24
forward/backward micro-batches, clipping and the optimizer step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEMO = str(ROOT / "configs" / "demo_cpu.yaml")
PROMPTS, N, NEW, MICRO, STEPS, ROUNDS = 12, 8, 3, 4, 4, 2
LONG_PREFIX = "Add the two numbers; reply with just the sum. "  # prompts of 68 tokens
CELLS = {  # prompt kind: (instruction prefix, model shape, max new tokens, eos probability, lr)
    "short": (False, "demo", NEW, None, 3e-3),
    "long": (True, "demo", NEW, None, 3e-3),
    # a 12.6M llama whose sampled lengths are EOS-driven (geometric, mean ~27 of 64 after the
    # cap): the lengths spread as a policy's do, so padding, packing and finished rows count;
    # a tiny lr keeps that law over the steps (Adam moves each weight ~lr a step, and the
    # shaped attention / MLP outputs are ~2e-5: 1e-5 already moved the mean length 27 -> 31-37)
    "realistic": (False, "12m", 64, 1 / 30, 1e-8),
}


def rows(long: bool) -> list[dict]:
    """The 100 problems in the verl parquet schema (hybridrl reads them; TRL gets the messages)."""
    out = []
    for a in range(10):
        for b in range(10):
            content = (LONG_PREFIX if long else "") + f"{a}+{b}="
            out.append({"data_source": "arithmetic", "prompt": [{"role": "user", "content": content}],
                        "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                        "extra_info": {"split": "train", "index": len(out)}})
    return out


from benchmarks.trl_model import make_folder  # noqa: E402
from benchmarks.trl_settings import hybridrl_settings, settings_mismatch, trl_settings  # noqa: E402


def _score(completion: str, truth: str) -> float:
    from hybridrl.rewards.gsm8k import compute_score

    return float(compute_score("arithmetic", completion, truth, method="flexible"))


# ----------------------------------------------------------------------------------- hybridrl
def _hybridrl_rank(rank, world, folder, data, steps, tmp, new, lr, extra=()):
    import warnings

    import torch

    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.train import build_layout
    from hybridrl.trainer.ppo import PPOTrainer

    warnings.filterwarnings("ignore")
    cfg = load_config([DEMO], [
        f"model.path={folder}", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
        f"data.train_batch_size={PROMPTS}", f"rollout.n={N}", f"rollout.response_length={new}", f"actor.lr={lr}",
        f"actor.ppo_mini_batch_size={PROMPTS}", f"actor.ppo_micro_batch_size_per_gpu={MICRO}",
        f"ref.log_prob_micro_batch_size_per_gpu={MICRO}", "trainer.kl_guard.max_kl=0",
        "reward.timeout_s=0", "data.max_prompt_length=96",
        f"trainer.total_steps={steps}", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.logger=[console]", f"trainer.output_dir={tmp}", *extra])
    cfg.check_world(world)
    train, gen = build_layout(cfg, world)
    torch.manual_seed(cfg.trainer.seed)
    trainer = PPOTrainer(cfg, build_groups(train, gen), print_fn=lambda *a, **k: None)
    step = trainer.train_step

    def cpu_timed_step():  # this rank's process CPU seconds beside the trainer's wall timing
        c0 = time.process_time()
        metrics = step()
        metrics["cpu_s/step"] = time.process_time() - c0
        return metrics

    trainer.train_step = cpu_timed_step
    hist = trainer.fit()
    return hist, hybridrl_settings(cfg, world, "actor/entropy" in hist[-1], torch.get_num_threads())


def run_hybridrl(world, folder, data, steps, tmp, new, lr, extra=()) -> dict:
    from hybridrl.testing.dist import run_on_ranks

    hist, settings = run_on_ranks(_hybridrl_rank, world, str(folder), str(data), steps, tmp,
                                  new, lr, list(extra), timeout=1800, preload=("megatron.core",))[0]
    kept = hist[1:] or hist
    phases = sorted({k for m in kept for k in m if k.startswith("timing_s/")})
    mean = {k: statistics.mean(m[k] for m in kept) for k in phases}
    gen_tokens = statistics.mean(m["response_length/mean"] for m in kept) * PROMPTS * N
    return {"step_s": mean["timing_s/step"], "tokens_per_s": gen_tokens / mean["timing_s/step"],
            "length": gen_tokens / (PROMPTS * N),
            "cpu_s": statistics.mean(m["cpu_s/step"] for m in kept),
            "shared": statistics.mean(m.get("perf/shared_prompt_frac", 0.0) for m in kept),
            "steps": {"step_s": [m["timing_s/step"] for m in kept],
                      "cpu_s": [m["cpu_s/step"] for m in kept]},
            "phases": {k[9:]: v for k, v in mean.items() if k != "timing_s/step"},
            "settings": settings}


# ---------------------------------------------------------------------------------------- TRL
def _time_phases(trainer, phases: dict) -> None:
    """Accumulate the seconds of TRL's step parts into ``phases`` (instance-level wrappers)."""
    import torch

    def timed(name, fn):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return wrapped

    logps = trainer._get_per_token_logps_and_entropies
    no_grad_logps = timed("ref", logps)  # the in-loss forward (grad on) belongs to the update

    def logps_seen(*a, **k):
        if torch.is_grad_enabled():  # the update's forward: does it compute the entropy?
            phases["entropy_in_update"] = bool(k.get("compute_entropy", False))
            return logps(*a, **k)
        return no_grad_logps(*a, **k)

    trainer._get_per_token_logps_and_entropies = logps_seen
    trainer._generate = timed("gen", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed("prepare",
                                                    trainer._generate_and_score_completions)


def trl_worker(folder: str, long: bool, steps: int, world: int, out: str, new: int,
               lr: float, seed: int = 1) -> None:
    """One TRL process (under torchrun when world > 1): writes per-step seconds to ``out``."""
    import warnings

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    data = Dataset.from_list([{"prompt": r["prompt"], "truth": r["reward_model"]["ground_truth"]}
                              for r in rows(long)])

    def reward(completions, truth, **_):
        return [_score(c[-1]["content"] if isinstance(c, list) else c, t)
                for c, t in zip(completions, truth)]

    times, cpu, tokens, steps_phases, phases = [], [], [], [], {}

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            phases.clear()
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)
            cpu.append(time.process_time() - self.c0)
            steps_phases.append({k: v for k, v in phases.items() if k != "entropy_in_update"})
            self.entropy = phases.get("entropy_in_update", False)

    seqs = PROMPTS * N // world  # per process; one optimizer step per generation batch
    # every option that changes the work, set to hybridrl's value (TRL 1.16 defaults to bf16
    # autocast and gradient checkpointing, a linear lr decay and no weight decay)
    args = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(out), "trl"), use_cpu=True, seed=seed,
        bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=MICRO, gradient_accumulation_steps=seqs // MICRO,
        generation_batch_size=PROMPTS * N, num_generations=N, max_completion_length=new,
        temperature=1.0, top_k=0, top_p=1.0, beta=0.001, epsilon=0.2, epsilon_high=0.2,
        importance_sampling_level="token", loss_type="dapo", scale_rewards="group",
        learning_rate=lr, lr_scheduler_type="constant", weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        max_steps=steps, num_iterations=1, logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0)
    timer = Timer()
    trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(folder),
                          callbacks=[timer])
    _time_phases(trainer, phases)
    trainer.train()
    settings = trl_settings(trainer, world, timer.entropy)
    for log in trainer.state.log_history:
        if "completions/mean_length" in log:
            tokens.append(log["completions/mean_length"])
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "cpu": cpu, "phases": steps_phases,
                       "mean_length": tokens, "settings": settings}, f)


def run_trl(world, folder, long, steps, tmp, new, lr, seed=1) -> dict:
    out = os.path.join(tmp, f"trl_{world}_{int(long)}_{new}.json")
    me = [str(Path(__file__).resolve()), "--trl-worker", str(folder), str(int(long)), str(steps),
          str(world), out, str(new), repr(lr), str(seed)]
    if world == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world}", *me]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"TRL run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
    with open(out) as f:
        res = json.load(f)
    kept = slice(1, None) if len(res["times"]) > 1 else slice(None)
    step = statistics.mean(res["times"][kept])
    length = statistics.mean(res["mean_length"]) if res["mean_length"] else new
    parts = res["phases"][kept]
    mean = {k: statistics.mean(p.get(k, 0.0) for p in parts)
            for k in ("gen", "ref", "reward", "prepare")}
    phases = {"gen": mean["gen"], "ref": mean["ref"], "reward": mean["reward"],
              "score_other": mean["prepare"] - mean["gen"] - mean["ref"] - mean["reward"],
              "update": step - mean["prepare"]}
    return {"step_s": step, "tokens_per_s": length * PROMPTS * N / step, "length": length,
            "cpu_s": statistics.mean(res["cpu"][kept]), "phases": phases,
            "steps": {"step_s": res["times"][kept], "cpu_s": res["cpu"][kept]},
            "settings": res["settings"]}


# --------------------------------------------------------------------------------------- main
def _breakdown(runs: list[dict]) -> str:
    """Mean ms and share of the step of each phase over the runs, largest first."""
    step = statistics.mean(r["step_s"] for r in runs)
    keys = {k for r in runs for k in r["phases"]}
    mean = {k: statistics.mean(r["phases"].get(k, 0.0) for r in runs) for k in keys}
    return ", ".join(f"{k} {v * 1e3:.0f} ms ({v / step:.0%})"
                     for k, v in sorted(mean.items(), key=lambda kv: -kv[1]) if v > 5e-4)


def _compare(ours: list[dict], theirs: list[dict], key: str) -> str:
    """Per side: the mean over rounds (range of the round means) and the fastest single step;
    TRL / hybridrl of the means (range of the per-round ratios) and of the fastest steps."""
    h, t = [r[key] for r in ours], [r[key] for r in theirs]
    h_min = min(x for r in ours for x in r["steps"][key])
    t_min = min(x for r in theirs for x in r["steps"][key])
    ratios = [b / a for a, b in zip(h, t)]
    return (f"{statistics.mean(h):>6.3f} ({min(h):.3f}-{max(h):.3f}) {h_min:>6.3f}"
            f" {statistics.mean(t):>6.3f} ({min(t):.3f}-{max(t):.3f}) {t_min:>6.3f}"
            f" {statistics.mean(t) / statistics.mean(h):>5.2f} ({min(ratios):.2f}-"
            f"{max(ratios):.2f}) {t_min / h_min:>5.2f}")


def _cell(world, kind, folder, data, args, tmp) -> tuple[list[dict], list[dict]]:
    """``args.rounds`` runs of each side, alternating which one goes first."""
    long, _, new, _, lr = CELLS[kind]
    ours, theirs = [], []
    for r in range(args.rounds):
        sides = [("h", ours), ("t", theirs)]
        for side, out in (sides if r % 2 == 0 else sides[::-1]):
            seed = r + 1  # each round its own sampling seed, the same number on both sides
            if side == "h":
                out.append(run_hybridrl(world, folder, data, args.steps,
                                        f"{tmp}/h{world}{kind}{r}", new, lr,
                                        [f"trainer.seed={seed}", *args.set]))
            else:
                out.append(run_trl(world, folder, long, args.steps, tmp, new, lr, seed))
    return ours, theirs


def _kernel_paths() -> str:
    """The SIMD path hybridrl's fused CPU ops take here (RMSNorm, SwiGLU/RoPE, KL), or why none."""
    import torch

    from hybridrl.kernels import ops
    from hybridrl.kernels.swiglu import swiglu_cpu_isa

    if os.environ.get(ops.FORCE_REFERENCE_ENV) == "reference":
        return f"off ({ops.FORCE_REFERENCE_ENV}=reference: eager torch ops run)"
    if not ops.compiled_available("rms_norm_fwd", "cpu"):
        return "not built (eager torch ops run: python setup.py build_ext --inplace)"
    return (f"RMSNorm {torch.ops.hybridrl.rms_norm_cpu_isa()}, SwiGLU/RoPE {swiglu_cpu_isa()}, "
            f"KL {ops.kl_cpu_isa()}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--trl-worker"]:
        folder, long, steps, world, out, new, lr, seed = argv[1:9]
        trl_worker(folder, long == "1", int(steps), int(world), out, int(new), float(lr),
                   int(seed))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompts", nargs="+", choices=tuple(CELLS), default=["short", "long"],
                    help="cells: short / long (demo model, 3 new tokens), realistic (12.6M "
                    "llama, EOS-driven lengths, up to 64 new tokens)")
    ap.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (first is warm-up)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="runs of each side per cell")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra hybridrl config overrides")
    args = ap.parse_args(argv)
    try:
        import trl
    except ImportError:
        print("TRL is not installed: .venv/bin/python -m pip install trl==1.16.0 (then rerun)")
        return 0
    import pandas as pd

    print(f"hybridrl vs TRL {trl.__version__} GRPO: {PROMPTS} prompts x {N}, "
          f"{'/'.join(str(CELLS[k][2]) for k in args.prompts)} new tokens ({'/'.join(args.prompts)}), "
          f"micro-batch {MICRO}, one optimizer step per batch, {args.steps} steps (first left "
          f"out), {args.rounds} rounds per side{' ' + ' '.join(args.set) if args.set else ''}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"hybridrl's CPU kernels: {_kernel_paths()}")
    print(f"{'':>16} {'hybridrl s/step':>27} {'TRL s/step':>27} {'TRL / hybridrl':>24}")
    print(f"{'procs':>5} {'prompt':>6} {'':>4} {'mean (range)':>20} {'min':>6} "
          f"{'mean (range)':>20} {'min':>6} {'mean (range)':>17} {'min':>6} "
          f"{'hybridrl tok/s':>14} {'TRL tok/s':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.prompts:
            long, shape, new, eos_p, _ = CELLS[kind]
            folder = Path(tmp) / f"model_{kind}"
            p = make_folder(folder, shape, eos_p)
            if p is not None:
                print(f"      {kind}: model {shape}, eos probability per sampled token {p:.4f} "
                      f"(lengths geometric, capped at {new})", flush=True)
            data = Path(tmp) / f"{kind}.parquet"
            pd.DataFrame(rows(long)).to_parquet(data)
            for world in args.worlds:
                load = os.getloadavg()[0]
                ours, theirs = _cell(world, kind, folder, data, args, tmp)
                differ = [line for o, t in zip(ours, theirs)
                          for line in settings_mismatch(o["settings"], t["settings"])]
                if differ:
                    print("refusing to report: the two sides do different work:\n  "
                          + "\n  ".join(sorted(set(differ))))
                    return 1
                if kind == args.prompts[0] and world == args.worlds[0]:
                    print("      effective settings, equal on both sides: " + ", ".join(
                        f"{k}={v}" for k, v in sorted(ours[0]["settings"].items())
                        if k != "processes"), flush=True)
                for what, key in (("wall", "step_s"), ("cpu", "cpu_s")):
                    tail = (f" {statistics.mean(r['tokens_per_s'] for r in ours):>14.0f}"
                            f" {statistics.mean(r['tokens_per_s'] for r in theirs):>10.0f}"
                            f"   (load {load:.1f} -> {os.getloadavg()[0]:.1f})"
                            if what == "wall" else "")
                    print(f"{world if what == 'wall' else '':>5} {kind if what == 'wall' else '':>6}"
                          f" {what:>4} {_compare(ours, theirs, key)}"
                          f"{tail}", flush=True)
                lengths = [statistics.mean(r["length"] for r in side) for side in (ours, theirs)]
                print(f"      mean response length: hybridrl {lengths[0]:.1f}, TRL "
                      f"{lengths[1]:.1f} (the same law on both sides: the draws differ)")
                print("      hybridrl step: " + _breakdown(ours))
                shared = statistics.mean(r["shared"] for r in ours)
                print(f"      hybridrl's exact savings without a TRL counterpart: packing, prompt "
                      f"sharing ({shared:.0%} of the rows' tokens spared in the training forwards; "
                      "--set model.share_prompts=false measures without), one prefill per "
                      "prompt in the engine")
                print("      TRL step:      " + _breakdown(theirs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
