"""Reshard benchmark on 8 gloo ranks: every strategy vs the wire limit vs megatron-core's refit.

    .venv/bin/python benchmarks/reshard.py [--layouts 4,2,2,1 2,2,2,1] [--repeats 3]
                                           [--bucket-mb 64] [--no-megatron]

For each layout "t,p,tg,pg" of the ~100M-parameter llama shape below (fp32), every rank holds its
megatron training shard as the trainer does (a GPTModel in megatron DDP with the distributed
optimizer: the stage's tensors lie in DDP's parameter buffer; with ``--no-megatron`` random
tensors in one buffer, last first, as that buffer holds them) and the script times, each as the
max over ranks of the median of ``--repeats`` runs after one warm-up:
- hybridrl's four strategies (plan once, then ``run_plan`` into gen-layout megatron shards);
- zero_redundancy into the builtin engine as the trainer runs it (in place, training-shard
  parts, own parts aliased), one message per transfer and merged (``Coalescing``: agreed in
  the warm-up; hybridrl.reshard.coalesce);
- the wire limit: one bare ``all_gather`` of the same bytes in the same (micro-DP) groups, one
  bare p2p batch of them (one message per peer), that batch plus one plain copy of the rows the
  rank keeps (what any reshard into separate engine tensors must also do), and one bare batch
  of the plan's own messages (each transfer of zero_redundancy's plan between plain buffers:
  what the message count alone costs);
- megatron-core's ``swap_model_weights`` (``megatron.core.resharding``) between a GPTModel on the
  training layout and one on the generation layout, over its gloo copy service; the first call
  (which plans) is reported apart from the steady state, and its result is compared bit for bit
  with hybridrl's zero_redundancy result.
It prints every time, bytes per rank and the ratios zero_redundancy / wire and
swap_model_weights / zero_redundancy.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.reshard_wire import max_over_ranks as _max  # noqa: E402
from benchmarks.reshard_wire import plan_messages_method, wire_methods  # noqa: E402
from hybridrl.reshard.specs import LlamaShape  # noqa: E402
from hybridrl.testing.dist import run_on_ranks  # noqa: E402

# ~100M parameters: 12 layers, hidden 768, GQA 12 heads / 4 groups, SwiGLU 2048, vocab 16000
SHAPE = LlamaShape(hidden=768, ffn=2048, heads=12, num_query_groups=4, layers=12, vocab=16000)
STRATEGIES = ("allgather", "vanilla", "zero_redundancy", "p2p")
ENGINE = "zero_redundancy -> builtin engine"
MERGED = "zero_redundancy -> engine, merged"
PLAN_MSGS = "wire: p2p batch, plan's messages"


def _rounds(methods, repeats, barrier):
    """Warm every method up, then ``repeats`` rounds running each method once (interleaved, so
    background load hits all methods alike; round k starts at the k-th method, so no method
    always runs right after the allocation-heavy baselines). {name: median seconds on this rank}."""
    for fn in methods.values():
        fn()
    times = {name: [] for name in methods}
    names = list(methods)
    for k in range(repeats):
        for name in names[k % len(names):] + names[:k % len(names)]:
            fn = methods[name]
            barrier()
            t0 = time.perf_counter()
            fn()
            barrier()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


class _CpuTracker:
    """megatron's CUDA RNG tracker as far as model construction needs it (CPU only)."""

    def fork(self, name="model-parallel-rng"):
        import contextlib

        return contextlib.nullcontext()

    def is_initialized(self):
        return True


def _build_model(groups, shape, pgc, gen):
    """A megatron-core GPTModel (local spec, CPU init) on the train layout, or on the gen layout."""
    import copy

    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import TransformerConfig

    mrandom._CUDA_RNG_STATE_TRACKER = _CpuTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tp, pp, pp_rank = groups.train.tp, groups.train.pp, groups.pp_rank
    if gen:
        pgc = copy.copy(pgc)
        pgc.tp, pgc.pp, pgc.dp = groups.gen_tp, groups.gen_pp, groups.gen_dp
        tp, pp, pp_rank = groups.size("gen_tp"), groups.size("gen_pp"), groups.index("gen_pp")
    cfg = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        use_cpu_initialization=True,  # init sets the TP attributes megatron's refit reads
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32)
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=shape.padded_vocab(groups.train.tp), max_sequence_length=128,
                    pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    pg_collection=pgc)


def _megatron_swap(groups, shape, pgc, src_model):
    """megatron-core's swap_model_weights train model -> gen model over gloo (CPU copy service).

    Returns (dst model, swap function, seconds of the first call, which also plans)."""
    import torch.distributed as dist
    from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService
    from megatron.core.resharding.refit import swap_model_weights

    class CpuGlooCopyService(GlooCopyService):
        def __init__(self):  # the parent creates a torch.cuda.Stream; nothing else needs CUDA
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.gloo_pg = dist.new_group(backend="gloo")
            self.send_ops, self.recv_ops, self._copy_stream = [], [], None

    dst = _build_model(groups, shape, pgc, gen=True)
    service = CpuGlooCopyService()
    dist.barrier()
    t0 = time.perf_counter()
    swap_model_weights(src_model, dst, service)
    first = time.perf_counter() - t0
    return dst, lambda: swap_model_weights(src_model, dst, service), first


def _megatron_check(groups, shape, dst, ours):
    """(bytes megatron received on this rank, its gen shard == hybridrl's zero_redundancy one)."""
    import torch
    import torch.distributed as dist

    rank, params = dist.get_rank(), dict(dst.named_parameters())
    recv = sum(params[op.param_name].data[op.my_slice].numel() * 4
               for op in dst._cached_reshard_plan.recv_ops if op.peer_rank != rank)
    chunk, b = shape.padded_vocab(groups.train.tp) // groups.size("gen_tp"), groups.index("gen_tp")
    real = max(0, min(chunk, shape.vocab - b * chunk))  # padding rows: megatron copies them, we don't
    same = True
    for name, ours_t in ours.items():
        theirs = params[name].data
        if "word_embeddings" in name or "output_layer" in name:
            theirs, ours_t = theirs[:real], ours_t[:real]
        same = same and torch.equal(theirs, ours_t)
    return recv, same


def _strategy_method(rank, cfg, layout, train, specs, named, strategy, info, results):
    """Plan ``strategy`` once; return a function running it into gen megatron tensors."""
    import torch

    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import check_same_plan, run_plan, train_sources
    from hybridrl.reshard.formats import megatron_format
    from hybridrl.reshard.placement import gen_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import storage_shape

    tg, pg = cfg["layout"][2:]
    gen = gen_placement(layout, SHAPE, tg, pg, "vanilla" if strategy == "vanilla" else "hybridflow")
    t0 = time.perf_counter()
    plan = plan_reshard(train, gen, specs, strategy, bucket_mb=cfg["bucket_mb"], itemsize=4)
    info[strategy] = {"plan_s": time.perf_counter() - t0, "planned": plan.recv_bytes(rank)}
    check_same_plan(plan)  # once per plan (plans are reused across steps, as megatron's is)
    sources = train_sources(plan, rank, named)
    into = None
    if strategy in ("zero_redundancy", "p2p"):  # into preallocated gen tensors, as an engine
        ga = gen.coords[rank][1]
        into = {s.local_name(pg, SHAPE.layers): torch.empty(storage_shape(s, tg, gen.vocab_chunk))
                for s in specs if s.on_stage(pg, SHAPE.layers, ga)}

    def once():
        asm = Assembler(plan, rank, megatron_format(gen, rank), into=into)
        stats = run_plan(plan, rank, sources, asm, verify=False)
        info[strategy].update(recv=stats.bytes_received, peak=stats.peak_live_bytes)
        result = asm.result()
        if strategy == "zero_redundancy":  # kept for the comparison with megatron
            results[strategy] = result

    return once, plan


def _engine_method(rank, cfg, groups, layout, train, specs, named, merged=False):
    """zero_redundancy into hybridrl's builtin engine, as the trainer runs it: the engine keeps
    its gen shard as t/tg training-shard-shaped parts (``engine_blocks``), received training
    shards land whole in them, and the rank's own shards are aliased (the engine reads the
    training tensor; megatron's vocab padding, so the vocabulary too)."""
    import torch

    from hybridrl.reshard.executor import check_same_plan
    from hybridrl.reshard.placement import gen_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec
    from hybridrl.rollout.engine_sync import Coalescing, sync_engine
    from hybridrl.rollout.worker import engine_blocks

    tg, pg = cfg["layout"][2:]
    gen = gen_placement(layout, SHAPE, tg, pg, "hybridflow")
    plan = plan_reshard(train, gen, specs, "zero_redundancy", bucket_mb=cfg["bucket_mb"], itemsize=4)
    check_same_plan(plan)
    spec = EngineSpec(SHAPE.hidden, SHAPE.ffn, SHAPE.heads, SHAPE.num_query_groups,
                      SHAPE.head_dim, SHAPE.layers, SHAPE.vocab, gen.vocab_chunk)
    engine = BuiltinEngine(spec, tp_group=groups.groups.get("gen_tp"), tp_rank=gen.coords[rank][0],
                           tp_size=tg, pp_size=pg, blocks=engine_blocks(train, gen))
    info = {"planned": plan.recv_bytes(rank)}
    coalescing = Coalescing() if merged else None  # the first call (the warm-up) agrees

    def once():
        stats = sync_engine(plan, rank, SHAPE, named, engine, torch.float32, alias=True,
                            verify=False, coalescing=coalescing)
        info.update(recv=stats.bytes_received, peak=stats.peak_live_bytes, msgs=stats.messages)

    return once, info, engine, plan


def _engine_same(engine, plan, rank, zr_result) -> bool:
    """The engine's tensors == zero_redundancy's gen shard (real vocab rows), bit for bit."""
    from hybridrl.reshard.formats import hf_name

    weights = engine.weights  # whole shards (built from the parts once)
    for spec in plan.specs:
        iv = plan.gen.interval(spec, rank)
        if iv is None:
            continue
        want = zr_result[spec.local_name(1, SHAPE.layers)]
        got = weights[hf_name(spec)]
        if spec.kind == "vocab":  # padding rows: zeroed by zero_redundancy, never read by the engine
            want, got = want[:iv[1] - iv[0]], got[:iv[1] - iv[0]]
        if not (got.shape == want.shape and bool((got == want).all())):
            return False
    return True


def _sources(rank, cfg, groups, train, specs):
    """This rank's training tensors: a megatron GPTModel's (and the model), or plain tensors."""
    import torch

    from hybridrl.reshard.specs import storage_shape

    t, p = cfg["layout"][:2]
    torch.manual_seed(1234)  # same seed everywhere: DP replicas agree, as in training
    if not cfg["megatron"]:
        a = train.coords[rank][1]
        shapes = {s.local_name(p, SHAPE.layers): storage_shape(s, t, train.vocab_chunk)
                  for s in specs if s.on_stage(p, SHAPE.layers, a)}
        # one buffer, last tensor first, as megatron DDP's parameter buffer holds them
        flat = torch.randn(sum(math.prod(x) for x in shapes.values()))
        views, at = {}, 0
        for name in reversed(list(shapes)):
            views[name] = flat.narrow(0, at, math.prod(shapes[name])).view(shapes[name])
            at += views[name].numel()
        return None, None, {name: views[name] for name in shapes}
    from hybridrl.models import cpu_compat
    from hybridrl.models.build import DDPOptions, _wrap_ddp
    from hybridrl.parallel.megatron import apply_megatron_groups

    pgc = apply_megatron_groups(groups)  # once: re-applying destroys megatron's groups
    model = _build_model(groups, SHAPE, pgc, gen=False)
    cpu_compat.install()
    # as the trainer holds it: megatron DDP with the distributed optimizer, whose parameter
    # buffer holds the stage's tensors back to back (reverse order, padded)
    _wrap_ddp(model, model.config, pgc, DDPOptions())
    return pgc, model, {n: prm.data for n, prm in model.named_parameters()}


def _bench_rank(rank, world, cfg):
    import torch.distributed as dist

    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import GenLayout, TrainLayout
    from hybridrl.reshard.placement import train_placement
    from hybridrl.reshard.specs import build_specs

    t, p, tg, pg = cfg["layout"]
    layout = TrainLayout(world, tp=t, pp=p)
    groups = build_groups(layout, GenLayout(layout, tp=tg, pp=pg))
    train, specs = train_placement(layout, SHAPE), build_specs(SHAPE)
    pgc, src_model, named = _sources(rank, cfg, groups, train, specs)
    methods, info, results, plans = {}, {}, {}, {}
    for strategy in STRATEGIES:
        methods[strategy], plans[strategy] = _strategy_method(
            rank, cfg, layout, train, specs, named, strategy, info, results)
    engines = {}
    if cfg["layout"][3] == 1:  # the builtin engine runs gen pp = 1
        for name in (ENGINE, MERGED):
            methods[name], info[name], engine, eplan = _engine_method(
                rank, cfg, groups, layout, train, specs, named, merged=name == MERGED)
            engines[name] = engine
    zr = plans["zero_redundancy"]
    local = sum((hi - lo) * zr.spec(k).row_numel * zr.itemsize for k, lo, hi in zr.locals[rank])
    wire, wire_bytes = wire_methods(groups, zr.recv_bytes(rank), local)
    methods.update(wire)
    for name in wire:
        info[name] = {"recv": wire_bytes, "planned": wire_bytes}
    methods[PLAN_MSGS], n_msgs = plan_messages_method(zr, rank)
    info[PLAN_MSGS] = {"recv": zr.recv_bytes(rank), "planned": zr.recv_bytes(rank), "msgs": n_msgs}
    if cfg["megatron"]:
        dst, swap, first = _megatron_swap(groups, SHAPE, pgc, src_model)
        methods["megatron swap_model_weights"] = swap
    secs = _rounds(methods, cfg["repeats"], dist.barrier)
    out = {name: {"s": _max(sec), **{k: _max(v) for k, v in info.get(name, {}).items()}}
           for name, sec in secs.items()}
    for name, engine in engines.items():
        out[name]["same"] = _max(0 if _engine_same(engine, eplan, rank, results["zero_redundancy"])
                                 else 1) == 0
    if cfg["megatron"]:
        recv, same = _megatron_check(groups, SHAPE, dst, results["zero_redundancy"])
        out["megatron swap_model_weights"].update(
            first_s=_max(first), recv=_max(recv), planned=_max(recv), same=_max(0 if same else 1) == 0)
    return out if rank == 0 else None


def _report(layout, res, world):
    t, p, tg, pg = layout
    M = SHAPE.num_params() * 4
    lines = [f"\nlayout: world {world}, train t={t} p={p} d={world // (t * p)} -> gen tg={tg} "
             f"pg={pg} (dg={(t * p) // (tg * pg)}); M = {M / 1e6:.1f} MB fp32 "
             f"({SHAPE.num_params() / 1e6:.1f}M params)",
             f"{'what':<30}{'seconds':>9}{'recv MB/rank':>14}{'planned MB':>12}{'peak MB':>10}"
             f"{'plan s':>8}"]
    for name, e in res.items():
        lines.append(f"{name:<30}{e['s']:>9.3f}{e['recv'] / 1e6:>14.1f}{e['planned'] / 1e6:>12.1f}"
                     f"{e.get('peak', 0) / 1e6:>10.1f}{e.get('plan_s', 0):>8.3f}")
    zr = res["zero_redundancy"]["s"]
    for name in ("wire: bare all_gather", "wire: bare p2p batch", "wire: p2p batch + own-row copy"):
        lines.append(f"ratio zero_redundancy / {name} = {zr / res[name]['s']:.2f}")
    for name in (ENGINE, MERGED) if ENGINE in res else ():
        lines.append(f"ratio {name} / wire: bare p2p batch = "
                     f"{res[name]['s'] / res['wire: bare p2p batch']['s']:.2f} "
                     f"({res[name]['msgs']:.0f} messages per rank at most); the engine's "
                     f"tensors == zero_redundancy's gen shard: {res[name]['same']}")
    if ENGINE in res:
        lines.append(f"ratio {ENGINE} / {PLAN_MSGS} ({res[PLAN_MSGS]['msgs']:.0f} messages "
                     f"received per rank at most) = {res[ENGINE]['s'] / res[PLAN_MSGS]['s']:.2f}; "
                     f"{PLAN_MSGS} / wire: bare p2p batch = "
                     f"{res[PLAN_MSGS]['s'] / res['wire: bare p2p batch']['s']:.2f}")
    for name in ("allgather", "vanilla", "p2p"):
        lines.append(f"ratio {name} / zero_redundancy = {res[name]['s'] / zr:.2f}")
    mg = res.get("megatron swap_model_weights")
    if mg:
        zr_first = zr + res["zero_redundancy"]["plan_s"]
        for name in (ENGINE, MERGED) if ENGINE in res else ():
            lines.append(f"ratio megatron swap_model_weights / {name} = "
                         f"{mg['s'] / res[name]['s']:.2f}")
        lines.append(f"ratio megatron swap_model_weights / zero_redundancy = {mg['s'] / zr:.2f} "
                     f"(steady); first call incl. planning: {mg['first_s']:.3f} s vs "
                     f"{zr_first:.3f} s = {mg['first_s'] / zr_first:.2f}; megatron's gen shard == "
                     f"hybridrl's: {mg['same']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--layouts", nargs="+", default=["4,2,2,1", "2,2,2,1"], help="t,p,tg,pg")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--no-megatron", action="store_true")
    args = ap.parse_args(argv)
    print(f"reshard benchmark: {args.world} gloo ranks on this machine, bucket {args.bucket_mb} MiB, "
          f"median of {args.repeats} after a warm-up, max over ranks")
    for spec in args.layouts:
        layout = tuple(int(x) for x in spec.split(","))
        t, p, tg, pg = layout
        if t % tg or p % pg or args.world % (t * p):
            ap.error(f"layout {spec}: needs tg | t, pg | p and t*p | world (zero_redundancy and "
                     "its micro-DP wire reference); p2p-only layouts are covered by the tests")
        cfg = {"layout": layout, "repeats": args.repeats, "bucket_mb": args.bucket_mb,
               "megatron": not args.no_megatron}
        t0 = time.perf_counter()
        res = run_on_ranks(_bench_rank, args.world, cfg, timeout=1200,
                           preload=("megatron.core",) if cfg["megatron"] else ())[0]
        print(_report(layout, res, args.world))
        print(f"(wall for this layout incl. model builds: {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
