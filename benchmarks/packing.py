"""Packed vs padded micro-batches on a length-varied PPO batch: the training phases of one step.

    .venv/bin/python benchmarks/packing.py [--worlds 1 2] [--rounds 3] [--seqs 64]
        [--lengths lognormal|uniform]   # uniform: 80 + 3 tokens each, nothing to unpad
    .venv/bin/python benchmarks/packing.py --attention   # the varlen attention's paths
    .venv/bin/python benchmarks/packing.py --pipeline    # pp 2: variable vs fixed pack shapes
    .venv/bin/python benchmarks/packing.py --shared      # shared prompts (shared_prompts.py)

The workload: ``--seqs`` sequences of a GAE PPO step, prompts 16-64 tokens (uniform), responses
from a lognormal (median 48 tokens, sigma 0.7: the 5-95 % range spans 10x, 10 to 150 tokens,
clipped to [1, 400]); a builtin llama (hidden 128, 4 layers, GQA 4/2 heads, SwiGLU 352, vocab
512, fp32). The training phases of one step, exactly the trainer's code paths
(``hybridrl.trainer.microbatches.forward_parts`` + ``RolloutBatch.microbatch`` +
``run_microbatches`` for the forwards, ``hybridrl.trainer.updates.ppo_updates`` for the updates):
old log-probs (actor), reference log-probs, values (critic), the critic update and the actor
update (two mini-batches, one epoch, the trainer's losses). Four sides, each from the same
weights, in ONE process group per world (1 rank: dp 1; 2 ranks: dp 2, the rows split by
``plan_rollout_partition`` as the trainer does):

- ``packed``: ``model.pack_sequences`` on (the default: automatic, a micro-batch whose rows all
  have one length keeps the padded layout, and each pack's attention takes its cheapest exact
  path), token budgets in real tokens;
- ``packed-always``: the same with every micro-batch packed (no padded fallback);
- ``padded-dynamic``: right-padded rows, the same token budgets counted in padded tokens (rows
  bucketed by length: the best padded setting, verl's ``use_dynamic_bsz``);
- ``padded-fixed``: right-padded micro-batches of ``--micro`` sequences (verl's default way).

Rounds alternate the order of the sides; printed per side: the median over rounds of the wall
and the process CPU seconds of the training phases (rank 0; CPU time is robust to a shared
machine's load; the first round is a warm-up and left out), the pad fraction
(``perf/pad_fraction``: padding share of the computed tokens), real tokens per second of the
last round (``perf/tokens_per_s``), micro-batches of a log-prob forward, and every side's ratio
to ``packed``. One torch thread per rank. ``--pipeline``: at pp 2 (2 ranks), the 1F1B
forward-backward over the packs as they are (``variable_seq_lengths``: megatron exchanges each
activation's shape first) vs the same packs padded at the tail to the longest (one fixed shape).
``--shared``: shared prompts, unshared vs shared packs (``benchmarks/shared_prompts.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIDES = ("packed", "packed-always", "padded-dynamic", "padded-fixed")
MODEL = dict(hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=352, vocab_size=512, max_position_embeddings=512)


def workload(n: int, seed: int = 0, lengths: str = "lognormal"):
    """(prompt lengths, response lengths) of the batch: ``lognormal`` (the length-varied mix
    above) or ``uniform`` (every prompt 80 tokens, every response 3: nothing to unpad)."""
    import random

    if lengths == "uniform":
        return [80] * n, [3] * n
    g = random.Random(seed)
    prompts = [g.randint(16, 64) for _ in range(n)]
    resp = [int(min(max(round(g.lognormvariate(math.log(48), 0.7)), 1), 400)) for _ in range(n)]
    return prompts, resp


def _rollout(n, rows, resp_width, lengths="lognormal"):
    import torch

    from hybridrl.rollout.batch import RolloutBatch

    prompts, resp = workload(n, lengths=lengths)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, MODEL["vocab_size"], (n, resp_width), generator=g)
    mask = (torch.arange(resp_width)[None, :] < torch.tensor(resp)[:, None]).long()
    p_ids = [torch.randint(3, MODEL["vocab_size"], (p,), generator=g).tolist() for p in prompts]
    full = RolloutBatch(p_ids, ids * mask, mask, torch.zeros(n, resp_width), list(range(n)),
                        [None] * n, ["x"] * n, [{}] * n)
    tensors = {"advantages": torch.randn(n, resp_width, generator=g),
               "returns": torch.randn(n, resp_width, generator=g),
               "old_log_probs": -torch.rand(n, resp_width, generator=g) * 3 - 4}
    tensors["values"] = tensors["returns"] * 0.5
    idx = torch.tensor(rows)
    rb = RolloutBatch([full.prompt_ids[i] for i in rows], full.response_ids[idx],
                      full.response_mask[idx], full.rollout_logprobs[idx], rows, [None] * len(rows),
                      ["x"] * len(rows), [{}] * len(rows), rows=rows)
    return rb, {k: v[idx] for k, v in tensors.items()}, [p + r for p, r in zip(prompts, resp)]


def _side_cfg(side, args):
    import dataclasses

    from hybridrl.config.roles import ActorConfig, CriticConfig

    dynamic = side != "padded-fixed"
    common = dict(ppo_mini_batch_size=args.seqs // 2, ppo_epochs=1, use_dynamic_bsz=dynamic,
                  ppo_max_token_len_per_gpu=args.budget, ppo_micro_batch_size_per_gpu=args.micro)
    return (dataclasses.replace(ActorConfig(), **common),
            dataclasses.replace(CriticConfig(), **common))


def _one_side(side, models, rb, tensors, partition, groups, args):
    """Seconds and token tally of the training phases of one step on this rank."""
    import functools

    from hybridrl.models.forward import run_microbatches
    from hybridrl.trainer.microbatches import TokenTally, forward_parts
    from hybridrl.trainer.updates import actor_loss_fn, critic_loss_fn, ppo_updates

    packed = side.startswith("packed")
    actor_cfg, critic_cfg = _side_cfg(side, args)
    tally = TokenTally()
    dynamic = side != "padded-fixed"
    # packed-always: every micro-batch a pack, even rows of one length (no padded fallback)
    force = (mock.patch("hybridrl.rollout.batch.pack_pays", lambda lens: True)
             if side == "packed-always" else contextlib.nullcontext())
    t0, c0 = time.perf_counter(), time.process_time()
    counts = []
    with force:
        for model in (models["actor"], models["reference"], models["critic"]):  # 3 forwards
            parts = forward_parts(rb.seq_lengths, args.micro, dynamic, 2 * args.budget, packed)
            mbs = [rb.microbatch(p, packed=packed) for p in parts]
            counts.append(len(mbs))
            with tally.count(mbs):
                run_microbatches(model, mbs, with_entropy=False)
        common = dict(partition=partition, groups=groups, n=1,
                      loss_scale=rb.response_ids.shape[1], temperature=1.0, packed=packed,
                      tally=tally)
        ppo_updates(models["critic"], models["critic_opt"], critic_cfg, rb, tensors,
                    functools.partial(critic_loss_fn, critic_cfg), "critic", **common)
        ppo_updates(models["actor"], models["actor_opt"], actor_cfg, rb, tensors,
                    functools.partial(actor_loss_fn, actor_cfg, False), "actor", **common)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    metrics = tally.pop_metrics(groups.gloo_dp if groups.dp_size > 1 else None)
    return seconds, cpu, metrics, counts[0]


def run_rank(rank, world, args):
    import warnings

    import torch

    from hybridrl.config.model import ModelConfig
    from hybridrl.models.hf_io import build_from_config
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.rollout.partition import plan_rollout_partition

    warnings.filterwarnings("ignore")
    groups = build_groups(TrainLayout(world=world, tp=1, pp=1))
    mc = ModelConfig(**MODEL)
    models = {role: build_from_config(mc, groups, role, seed=3)
              for role in ("actor", "reference", "critic")}
    models["actor_opt"] = ModelOptimizer(models["actor"], OptimConfig(lr=1e-7))
    models["critic_opt"] = ModelOptimizer(models["critic"], OptimConfig(lr=1e-7))
    _, resp = workload(args.seqs, lengths=args.lengths)
    lens = [p + r for p, r in zip(*workload(args.seqs, lengths=args.lengths))]
    parts = plan_rollout_partition(lens, groups.dp_size, args.seqs // 2)
    rb, tensors, _ = _rollout(args.seqs, parts[groups.dp_rank], max(resp), args.lengths)
    out = {s: [] for s in SIDES}
    for r in range(args.rounds + 1):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for side in order:
            torch.manual_seed(0)
            row = _one_side(side, models, rb, tensors, (parts, lens), groups, args)
            if r:  # round 0 warms up
                out[side].append(row)
    return out


def _report(world, res, args):
    prompts, resp = workload(args.seqs, lengths=args.lengths)
    lens = sorted(p + r for p, r in zip(prompts, resp))
    print(f"\nworld {world} (dp {world}, tp 1, pp 1), fp32, {args.lengths} lengths, {args.seqs} "
          f"sequences, lengths "
          f"{lens[0]}-{lens[-1]} (median {lens[len(lens) // 2]}, real tokens {sum(lens)}), "
          f"training phases = old + ref + values forwards, critic + actor updates")
    rank0 = res[0]

    def med(side, i):
        return statistics.median(row[i] for row in rank0[side])

    base_wall, base_cpu = med("packed", 0), med("packed", 1)
    print(f"{'side':<15} {'micro-batch mode':<34} {'wall s':>7} {'CPU s':>6} {'pad %':>6} "
          f"{'tok/s':>6} {'fwd mbs':>7} {'wall x':>7} {'CPU x':>6}")
    for side in SIDES:
        wall, cpu = med(side, 0), med(side, 1)
        m = rank0[side][-1][2]
        mode = (f"micro {args.micro} seqs" if side == "padded-fixed" else
                f"budget {args.budget} {'real' if side.startswith('packed') else 'padded'} tok "
                f"(fwd {2 * args.budget})")
        print(f"{side:<15} {mode:<34} {wall:>7.2f} {cpu:>6.2f} "
              f"{100 * m['perf/pad_fraction']:>6.1f} {m['perf/tokens_per_s']:>6.0f} "
              f"{rank0[side][-1][3]:>7d} {wall / base_wall:>6.2f}x {cpu / base_cpu:>5.2f}x")


def pipeline_rank(rank, world, args):
    """pp = 2: the packs as they are (variable shapes) vs padded at the tail to the longest."""
    import warnings

    import torch
    import torch.nn.functional as F

    from hybridrl.config.model import ModelConfig
    from hybridrl.data.batching import plan_micro_batches
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.hf_io import build_from_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    warnings.filterwarnings("ignore")
    groups = build_groups(TrainLayout(world=world, tp=1, pp=2))
    model = build_from_config(ModelConfig(**MODEL), groups, "actor", seed=3)
    _, resp = workload(args.seqs)
    rb, _, _ = _rollout(args.seqs, list(range(args.seqs)), max(resp))
    parts = plan_micro_batches(rb.seq_lengths, args.budget // 2, packed=True).micro_batches
    packs = [rb.microbatch(p, packed=True) for p in parts]
    longest = max(mb["input_ids"].shape[1] for mb in packs)
    fixed = [dict(mb, input_ids=F.pad(mb["input_ids"], (0, longest - mb["input_ids"].shape[1])))
             for mb in packs]  # the pad joins each pack's last sequence (packing.extend_tail)

    def loss(out, batch):
        return -out["logprobs"].mean(), {}

    out = {"variable": [], "fixed": []}
    for r in range(args.rounds + 1):
        for name, mbs in (("variable", packs), ("fixed", fixed)):
            model.config.variable_seq_lengths = name == "variable"
            t0 = time.perf_counter()
            torch.manual_seed(0)
            run_microbatches(model, mbs, loss, forward_only=False)
            if r:
                out[name].append(time.perf_counter() - t0)
    model.config.variable_seq_lengths = True
    return {"packs": len(packs), "real": sum(int(mb["cu_seqlens"][-1]) for mb in packs),
            "fixed_tokens": longest * len(packs),
            **{k: statistics.median(v) for k, v in out.items()}}


def pipeline_report(args) -> None:
    from hybridrl.testing.dist import run_on_ranks

    res = run_on_ranks(pipeline_rank, 2, args, timeout=1800, preload=("megatron.core",))[0]
    print(f"\npp 2 (2 ranks), {res['packs']} packs of a {args.budget // 2}-token budget, "
          f"{res['real']} real tokens, 1F1B forward + backward, median of {args.rounds} rounds:")
    print(f"variable shapes (variable_seq_lengths, shape handshake): {res['variable']:.2f} s, "
          f"pad 0 %")
    pad = 1 - res["real"] / res["fixed_tokens"]
    print(f"fixed shape (packs padded to the longest, {res['fixed_tokens']} tokens): "
          f"{res['fixed']:.2f} s, pad {100 * pad:.1f} %; fixed / variable "
          f"{res['fixed'] / res['variable']:.2f}x")


def attention_table() -> None:
    """Fwd + bwd ms of ``varlen_attention`` on each exact path, and the path the model picks."""
    import random

    import torch

    from hybridrl.models import packing

    torch.set_num_threads(1)
    rng = random.Random(0)
    print(f"fwd + bwd ms per path, one thread, 4 q / 2 kv heads of 32; call cost "
          f"{packing.CALL_COST_ELEMENTS} score elements; * = the path attention_path picks")
    print(f"{'pack':<28} {'S':>5} {'n':>3} " + " ".join(f"{p:>8}" for p in packing.PATHS[1:]))
    cells = (("uniform 16 x 83", [83] * 16), ("uniform 64 x 12", [12] * 64),
             ("lognormal mean ~80, n 16",
              [int(min(max(rng.lognormvariate(4.38, 0.7), 5), 400)) for _ in range(16)]),
             ("long tail 15 x 30 + 400", [30] * 15 + [400]),
             ("60 x 1 + 200", [1] * 60 + [200]), ("short mean 7, n 38",
                                                 [int(min(max(rng.lognormvariate(1.8, 0.6), 1),
                                                              40)) for _ in range(38)]))
    for name, lens in cells:
        s, cu = sum(lens), torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        qkv = [torch.randn(1, h, s, 32, requires_grad=True) for h in (4, 2, 2)]
        chosen, row = packing.attention_path(cu), []
        for path in packing.PATHS[1:]:
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                packing.varlen_attention(*qkv, cu, 0.25, path=path).sum().backward()
                best = min(best, time.perf_counter() - t0)
            row.append(f"{1e3 * best:>7.2f}{'*' if path == chosen else ' '}")
        print(f"{name:<28} {s:>5} {len(lens):>3} " + " ".join(row))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--budget", type=int, default=2048,
                        help="ppo_max_token_len_per_gpu (log-prob forwards: twice it)")
    parser.add_argument("--micro", type=int, default=8, help="padded-fixed: sequences each")
    parser.add_argument("--lengths", choices=("lognormal", "uniform"), default="lognormal",
                        help="uniform: 80-token prompts, 3-token responses (nothing to unpad)")
    parser.add_argument("--pipeline", action="store_true",
                        help="only pp 2: variable-shape packs vs packs padded to one shape")
    parser.add_argument("--shared", action="store_true",
                        help="only shared prompts: unshared vs shared packs (12.6M llama)")
    parser.add_argument("--attention", action="store_true",
                        help="only the varlen attention table (each exact path, and the pick)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.attention:
        return attention_table()
    if args.pipeline:
        return pipeline_report(args)
    if args.shared:
        from benchmarks.shared_prompts import shared_report

        return shared_report(args)
    from hybridrl.testing.dist import run_on_ranks

    print(f"packed vs padded training phases; load {os.getloadavg()[0]:.1f}")
    for world in args.worlds:
        res = run_on_ranks(run_rank, world, args, timeout=3000, preload=("megatron.core",))
        _report(world, res, args)


if __name__ == "__main__":
    main()
