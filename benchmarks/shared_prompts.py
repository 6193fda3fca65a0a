"""Shared prompts (``model.share_prompts``): unshared vs shared packs, the model and attention.

    .venv/bin/python benchmarks/packing.py --shared [--rounds 2]

The model: 1 rank, the realistic 12.6M llama of trl_compare (8 layers, hidden 384, FFN 1024, GQA 6/2, vocab 512, fp32); prompt groups of 8 samples, responses
geometric (mean ~28, cap 64, seeded), micro-batches of consecutive rows (one group's rows);
cells ``realistic`` (12 prompts of 20-24 tokens, 4 rows a micro-batch, as trl_compare) and
``512-token prompts`` (4 prompts, 8 rows a micro-batch); per side the process CPU seconds of
one forward + backward over every micro-batch (the update's work; the forward-only passes
scale alike) and of one forward-only pass, median over rounds after a warm-up, both sides
printed with unshared / shared.

Then the attention alone (fwd + bwd ms, one thread, 6 q / 2 kv heads of 64, min of 4): both
exact shared paths (``packing.shared_attention``: one [S, S] mask, or per group one SDPA over
cat(prompt K/V, own K/V)) on packs from the realistic cell to a 1k-token prompt with 16 long
responses, and the path ``packing.shared_path`` picks.
"""

from __future__ import annotations

import math
import os
import statistics
import time

SHARED_MODEL = dict(hidden_size=384, num_layers=8, num_attention_heads=6, num_query_groups=2,
                    ffn_hidden_size=1024, vocab_size=512, max_position_embeddings=640)
SHARED_CELLS = (("realistic", 12, (20, 24), 4), ("512-token prompts", 4, (512, 512), 8))


def _shared_rollout(prompts: int, plen: tuple[int, int], seed: int = 0):
    """``prompts`` groups of 8 rows: one prompt each, geometric responses (mean ~28, cap 64)."""
    import random

    import torch

    from hybridrl.rollout.batch import RolloutBatch

    g, n, width = random.Random(seed), prompts * 8, 64
    p_ids = []
    for _ in range(prompts):
        p = [g.randint(3, 511) for _ in range(g.randint(*plen))]
        p_ids += [p] * 8
    lens = [min(1 + int(math.log(1 - g.random()) / math.log(1 - 1 / 28)), width)
            for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None, :] < torch.tensor(lens)[:, None]).long()
    ids = torch.randint(3, 511, (n, width), generator=gen) * mask
    return RolloutBatch(p_ids, ids, mask, torch.zeros(n, width), [i // 8 for i in range(n)],
                        [None] * n, ["x"] * n, [{}] * n)


def shared_rank(rank, world, args):
    import warnings

    import torch

    from hybridrl.config.model import ModelConfig
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.hf_io import build_from_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    warnings.filterwarnings("ignore")
    groups = build_groups(TrainLayout(world=world, tp=1, pp=1))
    model = build_from_config(ModelConfig(**SHARED_MODEL), groups, "actor", seed=3)

    def loss(out, batch):
        return -out["logprobs"].mean(), {}

    out = {}
    for name, prompts, plen, micro in SHARED_CELLS:
        rb = _shared_rollout(prompts, plen)
        rows = list(range(len(rb)))
        sides = {share: [rb.microbatch(rows[s:s + micro], packed=True, share=share)
                         for s in range(0, len(rows), micro)] for share in (False, True)}
        times = {(share, kind): [] for share in (False, True) for kind in ("train", "fwd")}
        for r in range(args.rounds + 1):
            for share in ((False, True) if r % 2 == 0 else (True, False)):
                for kind in ("train", "fwd"):
                    torch.manual_seed(0)
                    c0 = time.process_time()
                    run_microbatches(model, sides[share], loss if kind == "train" else None,
                                     forward_only=kind == "fwd")
                    if r:
                        times[(share, kind)].append(time.process_time() - c0)
        out[name] = {"tokens": {share: sum(mb["input_ids"].shape[1] for mb in mbs)
                                for share, mbs in sides.items()},
                     "rows": len(rb), "micro": micro, "plen": plen,
                     "resp_mean": float(rb.response_lengths.float().mean()),
                     **{f"{k[1]}_{k[0]}": statistics.median(v) for k, v in times.items()}}
    return out


def shared_report(args) -> None:
    from hybridrl.testing.dist import run_on_ranks

    print(f"shared prompts (model.share_prompts), 1 rank, 12.6M llama fp32, one thread; load "
          f"{os.getloadavg()[0]:.1f}; process CPU s, median of {args.rounds} rounds")
    res = run_on_ranks(shared_rank, 1, args, timeout=1800, preload=("megatron.core",))[0]
    print(f"{'cell':<20} {'rows':>4} {'mb':>3} {'prompt':>8} {'resp':>5} {'tokens un/sh':>13} "
          f"{'fwd+bwd un':>10} {'sh':>6} {'x':>6} {'fwd un':>7} {'sh':>6} {'x':>6}")
    for name, c in res.items():
        t = c["tokens"]
        print(f"{name:<20} {c['rows']:>4} {c['micro']:>3} {c['plen'][0]:>3}-{c['plen'][1]:<4} "
              f"{c['resp_mean']:>5.1f} {t[False]:>6}/{t[True]:<6} "
              f"{c['train_False']:>10.2f} {c['train_True']:>6.2f} "
              f"{c['train_False'] / c['train_True']:>5.2f}x {c['fwd_False']:>7.2f} "
              f"{c['fwd_True']:>6.2f} {c['fwd_False'] / c['fwd_True']:>5.2f}x")

    attention_table()


def _cell(plen: int, resp: list[int], groups: int = 1):
    """(segment lengths, parents) of ``groups`` shared prompts with these responses."""
    lens, parents = [], []
    for _ in range(groups):
        p = len(lens)
        lens.append(plen - 1)
        parents.append(-1)
        for r in resp:
            lens.append(1 + r)
            parents.append(p)
    return lens, parents


def attention_table() -> None:
    import torch

    from hybridrl.models import packing

    torch.set_num_threads(1)
    cells = {"realistic 4 x (22 + ~28)": _cell(22, [28, 10, 45, 30]),
             "512 + 8 resp ~28": _cell(512, [28, 10, 45, 30, 5, 60, 20, 25]),
             "2 x (128 + 8 resp ~57)": _cell(128, [64, 20, 90, 60, 10, 120, 40, 50], 2),
             "256 + 4 resp 200": _cell(256, [200] * 4),
             "1024 + 16 resp ~280": _cell(1024, [300, 100, 450, 280, 50, 600, 200, 250] * 2)}
    print("\nshared attention, fwd + bwd ms, one thread, 6 q / 2 kv heads of 64, min of 4; "
          "* = the path shared_path picks")
    print(f"{'pack':<26} {'S':>6} {'mask':>9} {'grouped':>9}")
    for name, (lens, parents) in cells.items():
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        qkv = [torch.randn(1, h, int(cu[-1]), 64, requires_grad=True) for h in (6, 2, 2)]
        chosen, row = packing.shared_path(cu, parents), []
        for path in ("mask", "grouped"):
            mask = packing.shared_block_mask(cu, parents) if path == "mask" else None
            plan = packing.shared_plan(cu, parents) if path == "grouped" else None
            best = float("inf")
            for _ in range(4):
                c0 = time.process_time()
                packing.shared_attention(*qkv, cu, parents, 0.125, path=path, mask=mask,
                                         plan=plan).sum().backward()
                best = min(best, time.process_time() - c0)
            row.append(f"{1e3 * best:>8.2f}{'*' if path == chosen else ' '}")
        print(f"{name:<26} {int(cu[-1]):>6} " + " ".join(row))
