"""The builtin engine filled in place by the reshard, on 4 gloo ranks (hybridrl.rollout.worker).

``sync_engine`` writes received rows straight into the engine's tensors and, where a rank's gen
shard of a parameter is its training shard, makes the engine read the training tensor itself
(``inplace_targets``). Checked per rank against the engine loaded the independent way
(``update_weights`` with the oracle's engine-format shards, the path tested against
transformers): bit-identical weights, on three layouts (own stage aliased; nothing aliased
because gen tp < train tp; everything but the differently padded vocabulary aliased; with
megatron's vocab padding everything, so nothing travels), with and without
aliasing; the aliased tensors are the training tensors (same memory), an in-place change of
the training weights (an optimizer step) reaches the engine, and the next sync still equals
the oracle of the changed weights.
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks

# (train tp, train pp) on 4 ranks, gen tp, the engine's vocab padding (None: megatron's, so at
# gen tp = train tp the vocabulary chunks coincide too), the engine's parts K (blocks; K =
# t / tg: each part one training shard, the rank's own aliased; with 64-padding the vocabulary
# parts straddle training chunks, so received pieces are split across parts); gen pp = 1
CASES = [(2, 2, 2, 64, 1), (2, 1, 1, 64, 1), (2, 1, 2, 64, 1), (2, 1, 2, None, 1),
         (2, 2, 1, None, 2), (2, 1, 1, None, 2), (2, 1, 1, 64, 2)]


def _engine(shape, gen, rank, chunk, blocks=1):
    from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec

    spec = EngineSpec(shape.hidden, shape.ffn, shape.heads, shape.num_query_groups,
                      shape.head_dim, shape.layers, shape.vocab, chunk)
    b = gen.coords[rank][0]
    return BuiltinEngine(spec, tp_rank=b, tp_size=gen.tp, blocks=blocks,
                         tp_group=object() if gen.tp > 1 else None)


def _case_rank(rank, world, t, p, tg, pad, blocks, alias):
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.formats import hf_name
    from hybridrl.reshard.placement import gen_placement, train_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import build_specs
    from hybridrl.rollout.worker import sync_engine
    from tests.unit.test_reshard_oracle import PAD, SMALL, engine_shards, make_hf, megatron_shards

    tl = TrainLayout(world, tp=t, pp=p)
    train = train_placement(tl, SMALL)
    gen = gen_placement(tl, SMALL, tg, 1, "hybridflow", vocab_pad=pad)
    specs = build_specs(SMALL)
    plan = plan_reshard(train, gen, specs, "zero_redundancy", bucket_mb=0.004, itemsize=4)
    b, a, _ = train.coords[rank]
    gb = gen.coords[rank][0]
    out, snapshot = {}, {}
    # rows compared: all; of the vocabulary the real ones (the engine never reads padding rows,
    # and an aliased training tensor keeps its own)
    real = {hf_name(s): (gen.interval(s, rank)[1] - gen.interval(s, rank)[0]
                         if s.kind == "vocab" else None)
            for s in specs if gen.interval(s, rank) is not None}
    for step, seed in enumerate((3, 4)):
        hf = make_hf(SMALL, seed=seed)
        fresh = megatron_shards(SMALL, hf, t, b, p, a, train.vocab_chunk, pad_value=PAD)
        if step == 0:
            named = fresh
            engine = _engine(SMALL, gen, rank, gen.vocab_chunk, blocks)
        else:  # an optimizer step writes the training tensors in place
            for name, tensor in named.items():
                tensor.copy_(fresh[name])
            out["changed_before_sync"] = sorted(
                n for n, w in engine.weights.items() if not torch.equal(snapshot[n], w))
        stats = sync_engine(plan, rank, SMALL, named, engine, torch.float32, alias=alias)
        oracle = _engine(SMALL, gen, rank, gen.vocab_chunk)
        oracle.update_weights(engine_shards(SMALL, hf, tg, gb, 1, 0, gen.vocab_chunk).items())
        out[f"bad{step}"] = sorted(n for n in oracle.weights
                                   if not torch.equal(oracle.weights[n][:real[n]],
                                                      engine.weights[n][:real[n]]))
        out[f"missing{step}"] = engine.missing_weights()
        out[f"received{step}"] = stats.bytes_received
        snapshot.update((n, w.clone()) for n, w in engine.weights.items())
    # temporary send/receive buffers, with buckets large enough that no shard is split (but
    # several of them), and the order the executor posts buckets and waits for them in
    from hybridrl.reshard import executor

    big = plan_reshard(train, gen, specs, "zero_redundancy", bucket_mb=0.01, itemsize=4)
    events, bucket_cls = [], executor._Bucket

    class Recording(bucket_cls):
        def post(self):
            events.append("post")
            return super().post()

        def wait_and_deliver(self, *args):
            events.append("wait")
            super().wait_and_deliver(*args)

    executor._Bucket = Recording
    try:
        out["temp"] = sync_engine(big, rank, SMALL, named, engine, torch.float32,
                                  alias=alias).peak_comm_bytes
    finally:
        executor._Bucket = bucket_cls
    out["posted_before_first_wait"] = events.index("wait") if "wait" in events else 0
    out["buckets"] = events.count("post")
    out["aliased"] = sorted(engine.aliased)
    by_name = {hf_name(s): s.local_name(train.pp, train.num_layers) for s in specs}
    parts = {label: engine.store.parts[label.split("#")[0]][int(label.split("#")[1])]
             if "#" in label else engine.store.parts[label][0] for label in engine.aliased}
    out["same_memory"] = all(parts[label].data_ptr() == named[by_name[label.split("#")[0]]]
                             .data_ptr() for label in engine.aliased)
    out["changed_expected"] = sorted({label.split("#")[0] for label in engine.aliased})
    # what a rank holds whole in both layouts (same rows, same shape): its own stage's norms
    # (never split), its own stage's layers when each gen part is a training shard (tg == t,
    # or K = t / tg parts: the part of the rank's own train tp rank), and its vocabulary chunk
    # when the padding is megatron's too
    own = b % blocks
    out["expected"] = sorted(
        hf_name(s) + (f"#{own}" if blocks > 1 and s.kind != "norm" else "") for s in specs
        if alias and (tg * blocks == t or s.kind == "norm") and (s.kind != "vocab" or pad is None)
        and gen.interval(s, rank) is not None
        and train.interval(s, rank) is not None)
    return out


def _all_cases(rank, world):
    return {(t, p, tg, pad, k, alias): _case_rank(rank, world, t, p, tg, pad, k, alias)
            for t, p, tg, pad, k in CASES for alias in (True, False)}


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_all_cases, 4, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("alias", [True, False])
@pytest.mark.parametrize("t,p,tg,pad,blocks", CASES)
def test_inplace_sync_equals_the_engine_format_load(results, t, p, tg, pad, blocks, alias):
    for rank, per in enumerate(results):
        r = per[(t, p, tg, pad, blocks, alias)]
        assert r["bad0"] == [] and r["bad1"] == [], (rank, r["bad0"], r["bad1"])
        assert r["missing0"] == [] and r["missing1"] == []
        assert r["aliased"] == r["expected"], rank
        assert r["same_memory"]
        assert r["changed_before_sync"] == r["changed_expected"]  # it reads the training tensor
        assert r["received0"] == r["received1"]  # aliasing never changes what travels


@pytest.mark.slow
def test_aliasing_cases_are_not_vacuous(results):
    own_stage = [per[(2, 2, 2, 64, 1, True)]["aliased"] for per in results]
    assert all(own_stage) and all(len(a) < len(per[(2, 1, 2, 64, 1, True)]["aliased"])
                                  for a, per in zip(own_stage, results))
    # gen tp 1 < train tp 2 in one part: only the (unsplit) norms
    assert all(all("norm" in n for n in per[(2, 1, 1, 64, 1, True)]["aliased"]) for per in results)
    # ... in 2 parts: the rank's own training shard of every sharded tensor is one of them
    # (embedding, output layer, 4 per layer)
    assert all(sum("#" in n for n in per[(2, 1, 1, None, 2, True)]["aliased"]) == 2 + 4 * 8
               for per in results)
    # whole training shards travel into whole parts: no temporary buffer on either side,
    # where one part must take strided columns (o_proj, down_proj, gate_up) through them
    assert [per[(2, 1, 1, None, 2, True)]["temp"] for per in results] == [0] * 4
    assert all(per[(2, 1, 1, 64, 1, True)]["temp"] > 0 for per in results)
    # ... so the executor posts all those buckets at once; with temporary buffers it stops
    # posting ahead at the second bucket that needs one
    aligned = [per[(2, 1, 1, None, 2, True)] for per in results]
    assert all(r["buckets"] > 2 and r["posted_before_first_wait"] == r["buckets"]
               for r in aligned), aligned
    strided = [per[(2, 1, 1, 64, 1, True)] for per in results]
    assert all(2 <= r["posted_before_first_wait"] < r["buckets"] for r in strided), strided
    # tg == t on one stage: every rank's gen shard is its training shard but for the vocabulary,
    # so only the vocabulary rows travel (much less than the gather at gen tp 1)
    whole = [per[(2, 1, 2, 64, 1, True)]["received0"] for per in results]
    gathered = [per[(2, 1, 1, 64, 1, True)]["received0"] for per in results]
    assert all(w < g / 4 for w, g in zip(whole, gathered)), (whole, gathered)
    # ... and with megatron's vocab padding the layouts are equal: nothing travels at all
    assert [per[(2, 1, 2, None, 1, True)]["received0"] for per in results] == [0] * 4
