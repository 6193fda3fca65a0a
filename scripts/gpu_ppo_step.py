"""A first PPO (GRPO) loop on one device: builtin engine + megatron, world 1, a few steps.

    python scripts/gpu_ppo_step.py [--device cuda|cpu] [--size 0.5b|tiny | --tiny]
                                   [--arch llama,qwen3] [--steps 3] [--peak-tflops 989]

The CPU demo's loop (configs/demo_cpu.yaml: one-digit additions, GRPO, actor + reference with a
KL loss, the character tokenizer: vocab 100) on a random-weight model per ``--arch``:
- ``llama``: hybridrl's builtin llama; ``0.5b`` = hidden 1024, 24 layers, 16 heads / 8 query
  groups, SwiGLU 5632 (~0.49B parameters), bf16, 32 prompts x 8 responses of 128 tokens;
- ``qwen3``: a Qwen3-style HF folder written here with transformers (q/k RMSNorm, head_dim 128
  != hidden / heads, tied embeddings; ``0.5b`` = hidden 1024, 28 layers, 16 / 8 heads, SwiGLU
  3072, ~0.44B) and loaded through ``model.path`` (hybridrl.models supports Qwen3: any error
  building or running it fails the run like the llama's);
- ``tiny`` (or ``--tiny``): the demo's model sizes (fp32, 4 prompts x 4 responses of 3 tokens),
  so the whole script runs on a CPU in seconds (tests/unit/test_gpu_check_ppo.py runs it).
Several archs run one after another, each in its own process (a fresh process group).
The first step is a warm-up; the figures are means over the later ones, one ``SUMMARY: `` line
each (scripts/gpu_check.py copies them into summary.txt):
  generation  response + prompt tokens / timing_s/gen (prefill and decode of every sequence);
  training    sequence tokens x ppo_epochs / timing_s/update_actor (forward, backward, AdamW);
  MFU         model FLOPs / time / --peak-tflops (989: H200 dense bf16 datasheet), for the whole
              step and for the update phase; FLOPs: 2N per generated or prompt token, 2N per
              token per log-prob forward (old, ref, KL guard as run), 6N per trained token (8N
              with full recompute); N = actor parameters, attention's s^2 term left out;
  memory      torch.cuda.max_memory_allocated (and reserved) over the run, next to
              ``hybridrl plan --memory --config <this job> --model <its config.json>``'s largest
              phase, without the plan's fixed 3 GB reserve (cuda only; on cpu the plan alone);
  step        step seconds, its phases, whether every metric is finite.
Exit status 0 when every run finished with finite metrics, else non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARCHS = ("llama", "qwen3")
# size -> model (hidden, ffn, heads, query groups, layers, head_dim for qwen3), dtype, run knobs
SIZES = {
    "0.5b": dict(llama=(1024, 5632, 16, 8, 24, None), qwen3=(1024, 3072, 16, 8, 28, 128),
                 dtype="bf16", response=128, prompts=32, n=8, mini=16, micro=32, ref_micro=64,
                 bucket_mb=256),
    "tiny": dict(llama=(64, 128, 4, 2, 4, None), qwen3=(64, 128, 4, 2, 2, 32),
                 dtype="fp32", response=3, prompts=4, n=4, mini=2, micro=4, ref_micro=8,
                 bucket_mb=1),
}
PROMPT_MAX = 96  # configs/demo_cpu.yaml data.max_prompt_length
SUMMARY = "SUMMARY: "
RESERVE_GB = 3.0  # hybridrl.planning.memory.RESERVE_BYTES, the plan's fixed reserve


def overrides(arch: str, size: str, device: str, steps: int, tmp: str) -> list[str]:
    s = SIZES[size]
    hidden, ffn, heads, groups, layers, _ = s[arch]
    common = [f"model.dtype={s['dtype']}", f"rollout.response_length={s['response']}",
              f"rollout.n={s['n']}", f"data.train_batch_size={s['prompts']}",
              f"actor.ppo_mini_batch_size={s['mini']}",
              f"actor.ppo_micro_batch_size_per_gpu={s['micro']}",
              f"ref.log_prob_micro_batch_size_per_gpu={s['ref_micro']}", "actor.lr=1e-5",
              f"reshard.bucket_mb={s['bucket_mb']}",
              f"trainer.device={device}", f"trainer.total_steps={steps}", "trainer.save_freq=-1",
              "trainer.test_freq=-1", "trainer.logger=[console]", "trainer.kl_guard.max_kl=0",
              f"trainer.output_dir={tmp}", f"data.synthetic.dir={tmp}/data"]
    if arch == "qwen3":
        return common + [f"model.path={tmp}/qwen3", "model.tokenizer_path=char"]
    return common + [f"model.hidden_size={hidden}", f"model.ffn_hidden_size={ffn}",
                     f"model.num_attention_heads={heads}", f"model.num_query_groups={groups}",
                     f"model.num_layers={layers}",
                     f"model.max_position_embeddings={PROMPT_MAX + s['response']}"]


def hf_config(arch: str, size: str) -> dict:
    """The HF config.json of the model (the planner reads it; qwen3 is also built from it)."""
    s = SIZES[size]
    hidden, ffn, heads, groups, layers, head_dim = s[arch]
    cfg = dict(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
               num_key_value_heads=groups, num_hidden_layers=layers, vocab_size=100,
               max_position_embeddings=PROMPT_MAX + s["response"], rms_norm_eps=1e-5,
               tie_word_embeddings=arch == "qwen3")
    if arch == "qwen3":
        return {**cfg, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "head_dim": head_dim, "rope_theta": 1e6, "attention_bias": False}
    return {**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "rope_theta": 10000.0}


def write_qwen3(folder: str, size: str, device: str) -> None:
    """A random-weight Qwen3 folder (config.json + safetensors), built on ``device``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {k: v for k, v in hf_config("qwen3", size).items()
              if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**fields))
    dtype = torch.bfloat16 if SIZES[size]["dtype"] == "bf16" else torch.float32
    model.to(dtype).save_pretrained(folder, safe_serialization=True)


def plan_memory_gb(cfg, arch: str, size: str, spec: str, tmp: str, gpu_gb: float):
    """(largest phase, its GB without the reserve, the command) of ``hybridrl plan --memory``
    for this job: the run's config dumped to YAML and the model's config.json."""
    from hybridrl.config.loader import dump_config
    from hybridrl.planning.cli import main as plan_main

    model_json, run_yaml = Path(tmp) / "plan_config.json", Path(tmp) / "run.yaml"
    model_json.write_text(json.dumps(hf_config(arch, size)))
    run_yaml.write_text(dump_config(cfg))
    argv = ["--memory", "--model", str(model_json), "--world", "1", "--config", str(run_yaml),
            "--gpu-gb", str(gpu_gb), "--spec", spec, "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = plan_main(argv)
    if rc != 0:
        raise ValueError(out.getvalue().strip().splitlines()[-1] if out.getvalue() else
                         f"plan exit status {rc}")
    rep = json.loads(out.getvalue())
    phase = rep["largest_phase"]
    return phase, rep["totals"][phase] / 1e9 - RESERVE_GB, "hybridrl plan " + " ".join(argv)


def flops_per_step(n_params: int, m: dict, seq_tokens: float, gen_tokens: float, epochs: int,
                   recompute: bool) -> tuple[float, float]:
    """(FLOPs of the whole step, FLOPs of the actor update) by the module docstring's count."""
    forwards = sum(f"timing_s/{k}" in m for k in ("old_log_prob", "ref", "kl_guard"))
    update = (8 if recompute else 6) * n_params * seq_tokens * epochs
    return 2 * n_params * gen_tokens + 2 * n_params * seq_tokens * forwards + update, update


def report(label: str, history: list[dict], cfg, n_params: int, peak_tflops: float,
           memory: tuple | None, plan) -> list[str]:
    """The summary lines of one run (see the module docstring)."""
    kept = history[1:] or history

    def mean(key: str) -> float:
        return statistics.mean(m.get(key, float("nan")) for m in kept)

    seqs = cfg.data.train_batch_size * cfg.rollout.n
    resp, prompt = mean("response_length/mean") * seqs, mean("prompt_length/mean") * seqs
    seq_tokens, step = mean("perf/total_tokens"), mean("timing_s/step")
    gen_s, upd_s = mean("timing_s/gen"), mean("timing_s/update_actor")
    epochs = cfg.actor.ppo_epochs
    total, update = flops_per_step(n_params, kept[-1], seq_tokens, resp + prompt, epochs,
                                   cfg.model.recompute_granularity == "full")
    peak = peak_tflops * 1e12
    phases = sorted(k for k in kept[-1] if k.startswith("timing_s/") and k != "timing_s/step")
    finite = all(math.isfinite(v) for m in history for v in m.values() if isinstance(v, float))
    lines = [
        f"{label} generation: {(resp + prompt) / gen_s:,.0f} tokens/s ({resp:.0f} response + "
        f"{prompt:.0f} prompt tokens of {seqs} sequences in {gen_s:.2f} s)",
        f"{label} training: {seq_tokens * epochs / upd_s:,.0f} tokens/s ({epochs} epoch(s) of "
        f"{seq_tokens:.0f} tokens in {upd_s:.2f} s, fwd + bwd + AdamW)",
        f"{label} MFU: step {100 * total / step / peak:.1f}% ({total / step / 1e12:.1f} TFLOP/s), "
        f"update {100 * update / upd_s / peak:.1f}% of {peak_tflops:.0f} TFLOP/s "
        f"({n_params / 1e6:.0f}M parameters)",
    ]
    if isinstance(plan, tuple):
        phase, plan_gb, _ = plan
        said = f"plan --memory {phase} {plan_gb:.2f} GB (without its {RESERVE_GB:g} GB reserve)"
    else:
        said = f"plan --memory unavailable ({plan})"
    if memory:
        alloc, reserved = memory
        ratio = f", ratio {alloc / plan[1]:.2f}" if isinstance(plan, tuple) else ""
        lines.append(f"{label} memory: peak allocated {alloc:.2f} GB (reserved {reserved:.2f} "
                     f"GB) vs {said}{ratio}")
    else:
        lines.append(f"{label} memory: no device memory figure on cpu; {said}")
    lines.append(f"{label} step: {step:.2f} s over steps 2-{len(history)} ("
                 + ", ".join(f"{k[9:]} {mean(k):.2f}" for k in phases)
                 + f"); metrics finite: {finite}")
    return lines


def run_one(arch: str, size: str, device: str, steps: int, peak_tflops: float) -> int:
    """One arch in this process: build, fit ``steps`` steps, print its summary lines."""
    import warnings

    import torch
    import torch.distributed as dist

    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.testing.dist import free_port
    from hybridrl.trainer.ppo import PPOTrainer

    warnings.filterwarnings("ignore")
    cuda = device == "cuda"
    label = f"ppo {arch}-{size}"
    if cuda:
        torch.cuda.set_device(0)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}",
                            timeout=datetime.timedelta(seconds=300))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if arch == "qwen3":
                write_qwen3(f"{tmp}/qwen3", size, device)
            cfg = load_config([str(ROOT / "configs" / "demo_cpu.yaml")],
                              overrides(arch, size, device, steps, tmp))
            torch.manual_seed(cfg.trainer.seed)
            trainer = PPOTrainer(cfg, build_groups(TrainLayout(world=1)),
                                 print_fn=lambda *a, **k: None)
            n_params = sum(p.numel() for p in trainer.actor.module.parameters())
            spec = "te" if getattr(trainer.actor, "uses_te", False) else "local"
            try:
                plan = plan_memory_gb(cfg, arch, size, spec, tmp, 141.0 if cuda else 80.0)
                print(plan[2])
            except (ValueError, KeyError) as err:
                plan = str(err)[:160]
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            history = trainer.fit()
            memory = (torch.cuda.max_memory_allocated() / 1e9,
                      torch.cuda.max_memory_reserved() / 1e9) if cuda else None
    finally:
        dist.destroy_process_group()
    lines = report(label, history, cfg, n_params, peak_tflops, memory, plan)
    print("\n".join(SUMMARY + line for line in lines), flush=True)
    return 0 if lines[-1].endswith("True") else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    ap.add_argument("--tiny", action="store_true", help="same as --size tiny")
    ap.add_argument("--arch", default="llama", help=f"comma list of {','.join(ARCHS)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args(argv)
    size = "tiny" if args.tiny else args.size
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not archs or set(archs) - set(ARCHS):
        ap.error(f"--arch takes a comma list of {','.join(ARCHS)}, got {args.arch!r}")
    if args.steps < 2:
        ap.error(f"--steps must be >= 2 (the first is a warm-up), got {args.steps}")
    if len(archs) == 1:
        return run_one(archs[0], size, args.device, args.steps, args.peak_tflops)
    worst = 0
    for arch in archs:  # each in a fresh process: its own process group and megatron state
        cmd = [sys.executable, __file__, "--device", args.device, "--size", size, "--arch", arch,
               "--steps", str(args.steps), "--peak-tflops", str(args.peak_tflops)]
        rc = subprocess.call(cmd)
        if rc:
            print(f"{SUMMARY}ppo {arch}-{size}: FAILED (exit status {rc})", flush=True)
        worst = worst or rc
    return worst


if __name__ == "__main__":
    sys.exit(main())
