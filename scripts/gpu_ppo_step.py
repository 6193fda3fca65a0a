"""A world-1 PPO (GRPO) run on one device with the builtin engine: tokens/s, MFU, peak memory.

    python scripts/gpu_ppo_step.py [--device cuda|cpu] [--size 1b|tiny] [--steps 3]

The CPU demo's loop (configs/demo_cpu.yaml: one-digit additions, GRPO, n = 8, actor + reference,
KL loss) on a llama of ``--size``: ``1b`` = hidden 2048, 20 layers, 16 heads / 8 query groups,
SwiGLU 5632 (~0.95B parameters; vocab 100, the character tokenizer's), bf16, 64 new tokens;
``tiny`` = the demo's model in fp32 (a CPU dry run of this script). One rank: NCCL on cuda, gloo
on cpu. Prints, per step after the first (warm-up): the step time and its phases (timing_s/*),
tokens/s (prompt + response tokens of the batch / step time), the peak device memory
(``torch.cuda.max_memory_allocated``, cuda only) and an MFU estimate: model FLOPs per step /
step time / ``--peak-tflops`` (989, H200 bf16 dense), with FLOPs = 2N per generated token
(decode) + (2N ref + 2N old log-probs + 6N actor update) per sequence token, N = parameters.
Exit status 0 when every step's metrics are finite, else 1.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {  # hidden, ffn, heads, query groups, layers, dtype, response length
    "1b": (2048, 5632, 16, 8, 20, "bf16", 64),
    "tiny": (64, 128, 4, 2, 4, "fp32", 3),
}


def overrides(size: str, device: str, steps: int, tmp: str) -> list[str]:
    hidden, ffn, heads, groups, layers, dtype, new = SIZES[size]
    return [f"model.hidden_size={hidden}", f"model.ffn_hidden_size={ffn}",
            f"model.num_attention_heads={heads}", f"model.num_query_groups={groups}",
            f"model.num_layers={layers}", f"model.dtype={dtype}",
            f"model.max_position_embeddings={128 + new}", f"rollout.response_length={new}",
            "actor.ppo_mini_batch_size=12", "actor.ppo_micro_batch_size_per_gpu=8",
            "ref.log_prob_micro_batch_size_per_gpu=16", "actor.lr=1e-5",
            f"trainer.device={device}", f"trainer.total_steps={steps}", "trainer.save_freq=-1",
            "trainer.test_freq=-1", "trainer.logger=[console]", "trainer.kl_guard.max_kl=0",
            f"trainer.output_dir={tmp}", f"data.synthetic.dir={tmp}/data"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args(argv)
    import warnings

    import torch
    import torch.distributed as dist

    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.ppo.trainer import PPOTrainer
    from hybridrl.testing.dist import free_port

    warnings.filterwarnings("ignore")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}",
                            timeout=datetime.timedelta(seconds=300))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config([str(ROOT / "configs" / "demo_cpu.yaml")],
                          overrides(args.size, args.device, args.steps, tmp))
        torch.manual_seed(cfg.trainer.seed)
        trainer = PPOTrainer(cfg, build_groups(TrainLayout(world=1)), print_fn=lambda *a, **k: None)
        n_params = sum(p.numel() for p in trainer.actor.module.parameters()) \
            if hasattr(trainer, "actor") and hasattr(trainer.actor, "module") else None
        history = trainer.fit()
    dist.destroy_process_group()
    kept = history[1:] or history
    step = statistics.mean(m["timing_s/step"] for m in kept)
    tokens_per_s = statistics.mean(m["perf/throughput"] for m in kept)
    resp = statistics.mean(m["response_length/mean"] for m in kept)
    print(f"{args.size} llama on {args.device}, {len(history)} steps (first left out): "
          f"step {step:.3f} s, {tokens_per_s:.0f} tokens/s, response length {resp:.1f}")
    phases = sorted({k for m in kept for k in m if k.startswith("timing_s/")} - {"timing_s/step"})
    print("phases: " + ", ".join(f"{k[9:]} {statistics.mean(m[k] for m in kept):.3f} s"
                                 for k in phases))
    if cuda:
        print(f"peak memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if n_params:
        seqs = cfg.data.train_batch_size * cfg.rollout.n
        seq_tokens = tokens_per_s * step  # prompt + response tokens of the batch
        flops = 2 * n_params * resp * seqs + 10 * n_params * seq_tokens
        print(f"parameters {n_params / 1e6:.1f} M; MFU estimate {flops / step / 1e12:.1f} "
              f"TFLOP/s = {100 * flops / step / (args.peak_tflops * 1e12):.1f}% of "
              f"{args.peak_tflops:.0f}")
    finite = all(math.isfinite(v) for m in history for v in m.values()
                 if isinstance(v, float))
    print("metrics finite:", finite)
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
