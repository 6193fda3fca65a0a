"""``hybridrl plan --gen-world N``: the split placement's weight sync, bytes per rank and balance.

Contract: ``split_report(shape, world, tp, pp, gen_world, gen_tp, itemsize, bucket_mb, gbps,
vocab_pad)`` (pure) -> a dict: the two rank sets (training ranks ``0 .. world-N-1``, generation
ranks after them, ``gen_tp`` consecutive ranks per replica), ``received_per_gen_rank`` (each
generation rank's engine shard: M/tg bytes), ``sent_per_train_rank`` (per training rank),
``send_balance`` (max / mean bytes sent over the training ranks; 1.0 = even),
``total_bytes`` (= replicas x M), ``est_seconds`` (the busiest rank's bytes in or out over
``gbps``), ``seconds_at_gbps`` ({link Gbit/s: seconds} for each of ``links``: the same busiest
rank over each link speed; the buckets are pipelined, so the wire, not the copy, bounds the
sync: a lower bound at full link rate) and ``counted``: ``plan`` (the enumerated ``split`` plan, worlds up to
``EXACT_UP_TO`` ranks) or ``summary`` (``reshard.summary``: layers counted with a
multiplicity; a rank's sent bytes then within a few % of the plan's, received exact).
``split_text(report)``: the human form. A MoE model (``shape.num_experts``): ``ep`` / ``etp``
(0 = tp) place the training experts as megatron does (``reshard.placement.train_placement``);
each expert's bytes are sent by the EP ranks holding it, ``train`` reports both sizes.
"""

from __future__ import annotations

from hybridrl.parallel.layout import TrainLayout
from hybridrl.reshard.placement import split_placements
from hybridrl.reshard.planner import SPLIT, plan_reshard
from hybridrl.reshard.specs import build_specs
from hybridrl.reshard.summary import summarize

EXACT_UP_TO = 32


def split_report(shape, world: int, tp: int, pp: int, gen_world: int, gen_tp: int,
                 itemsize: int, bucket_mb: float, gbps: float, vocab_pad: int | None,
                 links: tuple[float, ...] = (), ep: int = 1, etp: int = 0) -> dict:
    if not 0 < gen_world < world:
        raise ValueError(f"--gen-world must be in 1 .. world-1 = {world - 1}, got {gen_world}")
    layout = TrainLayout(world=world - gen_world, tp=tp, pp=pp, ep=ep, etp=etp or None)
    train, gen = split_placements(layout, shape, gen_world, gen_tp, 1, vocab_pad)
    specs = build_specs(shape)
    t_ranks, g_ranks = range(layout.world), range(layout.world, world)
    if world <= EXACT_UP_TO:
        plan = plan_reshard(train, gen, specs, SPLIT, bucket_mb, itemsize)
        recv = [plan.recv_bytes(r) for r in range(world)]
        sent = [plan.sent_bytes(r) for r in range(world)]
        counted = "plan"
    else:
        s = summarize(train, gen, specs, SPLIT, itemsize, int(bucket_mb * (1 << 20)))
        recv, sent, counted = list(s.recv), list(s.sent), "summary"
    sent_t = [sent[r] for r in t_ranks]
    mean = sum(sent_t) / len(sent_t)
    busiest = max(max(recv), max(sent))
    return {"placement": "split", "world": world, "counted": counted,
            "model_bytes": shape.num_params() * itemsize,
            "train": {"ranks": [0, layout.world - 1], "tp": tp, "pp": pp, "dp": layout.dp,
                      **({"ep": ep, "etp": layout.etp} if shape.num_experts else {})},
            "gen": {"ranks": [layout.world, world - 1], "tp": gen_tp,
                    "replicas": gen_world // gen_tp},
            "received_per_gen_rank": [recv[r] for r in g_ranks],
            "sent_per_train_rank": sent_t,
            "send_balance": max(sent_t) / mean if mean else 1.0,
            "total_bytes": sum(recv), "est_seconds": busiest * 8 / (gbps * 1e9),
            "busiest_bytes": busiest,
            "seconds_at_gbps": {f"{g:g}": busiest * 8 / (g * 1e9) for g in links}}


def _compact(values: list[int], unit: float = 1e9) -> str:
    shown = ", ".join(f"{v / unit:.3f}" for v in values[:8])
    return shown + (f", ... ({len(values)} ranks)" if len(values) > 8 else "")


def split_text(rep: dict, model: str, gbps: float) -> str:
    t, g = rep["train"], rep["gen"]
    return "\n".join([
        f"{model}: M = {rep['model_bytes'] / 1e9:.2f} GB, world {rep['world']}, split placement",
        f"  training ranks {t['ranks'][0]}..{t['ranks'][1]}: p x t x d = {t['pp']} x {t['tp']} "
        f"x {t['dp']}",
        f"  generation ranks {g['ranks'][0]}..{g['ranks'][1]}: tg {g['tp']} x {g['replicas']} "
        "replicas",
        f"  received per gen rank GB:   {_compact(rep['received_per_gen_rank'])}",
        f"  sent per train rank GB:     {_compact(rep['sent_per_train_rank'])}",
        f"  send balance (max / mean):  {rep['send_balance']:.3f}",
        f"  total moved {rep['total_bytes'] / 1e9:.3f} GB, est {rep['est_seconds']:.3f} s @ "
        f"{gbps:g} Gb/s (busiest rank; counted from the {rep['counted']})",
        *([f"  sync seconds (busiest rank, {rep['busiest_bytes'] / 1e9:.3f} GB) per link: "
           + ", ".join(f"{s:.2f} s @ {g} Gb/s" for g, s in rep["seconds_at_gbps"].items())]
          if rep.get("seconds_at_gbps") else [])])
