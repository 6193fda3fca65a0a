"""One training step and one reference forward of the demo model: megatron's local layer spec,
hybridrl's lean local spec (hybridrl/models/local_spec.py) and transformers, in ONE process.

    .venv/bin/python benchmarks/model_step.py [--seq 25 71] [--rounds 7]

The model and micro-batching of benchmarks/trl_compare.py: the CPU demo's llama (4 layers, hidden
64, GQA 4/2, vocab 100; the same random weights loaded by all three), 24 micro-batches of 4
sequences of ``--seq`` tokens (25: the short prompts' 22 + 3 new tokens, 71: the long ones).
Training step: forward + backward of every micro-batch (loss -mean(log p) - 0.01 mean(entropy),
averaged over micro-batches), gradient clipping at 1.0 and one Adam step: megatron's
``train_step`` (DDP fp32 main grads, megatron's optimizer) vs transformers' model (sdpa
attention, as TRL loads it) with torch's AdamW. Reference forward: the 24 micro-batches without
gradients to per-token log-probs (megatron's ``run_microbatches``; transformers' logits ->
log_softmax -> gather). Rounds alternate the order of the three; printed per (seq, part): the
minimum and median over rounds (the first left out) of the process CPU time (robust to a shared
machine's load) and of wall time, and each side's ratio to transformers' CPU time. World 1,
one torch thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N_MICRO, MICRO = 24, 4


def _megatron_spec(use_te, qk_norm=False):
    from megatron.core.models.gpt import gpt_layer_specs

    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm",
                                                    qk_layernorm=qk_norm)


def _build_megatron(folder, groups, lean: bool):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from hybridrl.models import build
    from hybridrl.models.hf_io import build_from_hf
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig

    lean_spec, build.layer_spec = build.layer_spec, (build.layer_spec if lean else _megatron_spec)
    try:
        actor = build_from_hf(folder, groups, "actor")
        ref = build_from_hf(folder, groups, "reference")
    finally:
        build.layer_spec = lean_spec
    if not lean:  # megatron's own output layer as well
        for m in (actor, ref):
            m.module.output_layer.__class__ = ColumnParallelLinear
    opt = ModelOptimizer(actor, OptimConfig(lr=1e-4, weight_decay=0.0, grad_clip=1.0))
    return actor, opt, ref


def _megatron_fns(folder, groups, lean):
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.train_step import train_step

    actor, opt, ref = _build_megatron(folder, groups, lean)

    def loss_fn(out, batch):
        return -out["logprobs"].mean() - 0.01 * out["entropy"].mean(), {}

    return (lambda mbs: train_step(actor, opt, mbs, loss_fn),
            lambda mbs: run_microbatches(ref, mbs, with_entropy=False))


def _hf_fns(folder):
    import torch
    from transformers import AutoModelForCausalLM

    from hybridrl.models.forward import next_token_labels

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

    def logp_entropy(m, ids):
        logp_BTV = torch.log_softmax(m(ids, attention_mask=torch.ones_like(ids)).logits.float(), -1)
        logp = logp_BTV.gather(-1, next_token_labels(ids).unsqueeze(-1)).squeeze(-1)
        return logp, -(logp_BTV.exp() * logp_BTV).sum(-1)

    def train(mbs):
        opt.zero_grad()
        for mb in mbs:
            logp, ent = logp_entropy(model, mb["input_ids"])
            ((-logp.mean() - 0.01 * ent.mean()) / len(mbs)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def forward(mbs):
        with torch.no_grad():
            for mb in mbs:
                logp_entropy(ref, mb["input_ids"])

    return train, forward


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[25, 71])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from benchmarks.trl_compare import make_folder
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"demo model, {N_MICRO} micro-batches of {MICRO}, world 1, 1 thread; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        make_folder(Path(tmp))
        groups = build_groups(TrainLayout(world=1, tp=1, pp=1))
        sides = {"megatron local spec": _megatron_fns(tmp, groups, lean=False),
                 "hybridrl lean spec": _megatron_fns(tmp, groups, lean=True),
                 "transformers": _hf_fns(tmp)}
        for seq in args.seq:
            gen = torch.Generator().manual_seed(seq)
            mbs = [{"input_ids": torch.randint(4, 100, (MICRO, seq), generator=gen)}
                   for _ in range(N_MICRO)]
            times = {(s, p): ([], []) for s in sides for p in ("train", "ref")}
            for r in range(args.rounds):
                for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    for part, fn in zip(("train", "ref"), sides[side]):
                        c0, w0 = time.process_time(), time.perf_counter()
                        fn(mbs)
                        if r:
                            times[(side, part)][0].append(time.process_time() - c0)
                            times[(side, part)][1].append(time.perf_counter() - w0)
            for part in ("train", "ref"):
                base = min(times[("transformers", part)][0])
                for side in sides:
                    cpu, wall = times[(side, part)]
                    print(f"seq {seq:3d} {part:5s} {side:20s} cpu min {min(cpu) * 1e3:6.1f} ms "
                          f"med {statistics.median(cpu) * 1e3:6.1f}  wall min "
                          f"{min(wall) * 1e3:6.1f} med {statistics.median(wall) * 1e3:6.1f}  "
                          f"/ transformers {min(cpu) / base:.2f}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
