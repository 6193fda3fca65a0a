"""Merged messages (hybridrl.reshard.coalesce) into the builtin engine, on 4 gloo ranks.

Each rank's training tensors lie in one flat buffer, in reverse order with gaps after some
(as megatron DDP's parameter buffer holds them: reversed, start/bucket padding). A sync with
``Coalescing`` agrees once which transfers travel together and lays the engine's received parts
out in the senders' order; checked against the engine loaded the independent way (engine-format
shards of the oracle): bit-identical weights at the agreeing sync and the next one (changed
weights, a replay of the recorded first), fewer messages than transfers, no temporary buffer. Then the memory moves under the
agreement (training tensors re-allocated one by one; engine parts re-laid in another order):
the next syncs are still bit-identical, through packing/unpacking buffers. A rank that skips
coalescing while its peers use it, or starts agreeing again while they run agreed messages,
makes every rank raise instead of hanging; so does a wrong-shaped training tensor on one rank
at the first merged sync.
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks

# (train tp, train pp, gen tp, engine parts K, alias) on 4 ranks, megatron's vocab padding, gen
# pp 1 (alias False: the rank's own rows are copied, by the replay too)
CASES = [(2, 2, 2, 1, True), (2, 2, 1, 2, True), (2, 1, 1, 2, True), (1, 2, 1, 1, True),
         (2, 2, 1, 2, False)]


def _flat(named: dict, gap_every: int = 3) -> dict:
    """The tensors copied into one buffer, last first, 16 spare elements after every third."""
    names = list(named)[::-1]
    gaps = [16 if i % gap_every == gap_every - 1 else 0 for i in range(len(names))]
    flat = torch.zeros(sum(named[n].numel() for n in names) + sum(gaps))
    out, at = {}, 0
    for name, gap in zip(names, gaps):
        n = named[name].numel()
        out[name] = flat.narrow(0, at, n).view(named[name].shape).copy_(named[name])
        at += n + gap
    return {name: out[name] for name in named}


def _case_rank(rank, world, t, p, tg, blocks, alias):
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.formats import hf_name
    from hybridrl.reshard.placement import gen_placement, train_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import build_specs
    from hybridrl.rollout.engine_sync import Coalescing, sync_engine
    from tests.distributed.test_engine_inplace import _engine
    from tests.unit.test_reshard_oracle import PAD, SMALL, engine_shards, make_hf, megatron_shards

    tl = TrainLayout(world, tp=t, pp=p)
    train = train_placement(tl, SMALL)
    gen = gen_placement(tl, SMALL, tg, 1, "hybridflow", vocab_pad=None)
    plan = plan_reshard(train, gen, build_specs(SMALL), "zero_redundancy", bucket_mb=0.05,
                        itemsize=4)
    b, a, _ = train.coords[rank]
    gb = gen.coords[rank][0]
    real = {hf_name(s): (gen.interval(s, rank)[1] - gen.interval(s, rank)[0]
                         if s.kind == "vocab" else None)
            for s in plan.specs if gen.interval(s, rank) is not None}
    engine, coalescing, out = _engine(SMALL, gen, rank, gen.vocab_chunk, blocks), Coalescing(), {}
    plain = _engine(SMALL, gen, rank, gen.vocab_chunk, blocks)
    named = None
    for step, seed in enumerate((3, 4, 5, 6)):
        hf = make_hf(SMALL, seed=seed)
        fresh = megatron_shards(SMALL, hf, t, b, p, a, train.vocab_chunk, pad_value=PAD)
        if step < 2:  # one flat buffer, rewritten in place
            named = _flat(fresh) if named is None else {n: x.copy_(fresh[n]) for n, x in named.items()}
        elif step == 2:  # the training tensors moved: one allocation each
            named = {n: x.clone() for n, x in fresh.items()}
        else:  # ... and the engine's parts were laid out again, in another order
            named = {n: x.clone() for n, x in fresh.items()}
            store = engine.store
            engine.arrange([(n, k if len(ps) > 1 else None) for n, ps in
                            sorted(store.parts.items(), reverse=True) for k in range(len(ps))
                            if store.label(n, k) not in store.aliased])
        had = coalescing.replay
        stats = sync_engine(plan, rank, SMALL, named, engine, torch.float32, alias=alias,
                            coalescing=coalescing)
        out[f"replayed{step}"] = had is not None and coalescing.replay is had
        oracle = _engine(SMALL, gen, rank, gen.vocab_chunk)
        oracle.update_weights(engine_shards(SMALL, hf, tg, gb, 1, 0, gen.vocab_chunk).items())
        out[f"bad{step}"] = sorted(n for n in oracle.weights
                                   if not torch.equal(oracle.weights[n][:real[n]],
                                                      engine.weights[n][:real[n]]))
        out[f"messages{step}"], out[f"temp{step}"] = stats.messages, stats.peak_comm_bytes
        out[f"received{step}"] = stats.bytes_received
    base = sync_engine(plan, rank, SMALL, named, plain, torch.float32, alias=alias)
    out["messages_plain"], out["received_plain"] = base.messages, base.bytes_received
    out["agreed"] = (coalescing.merges.messages, coalescing.merges.transfers)
    out["holes"] = coalescing.merges.gap_bytes
    # the fewest messages possible: one per bucket and peer, each direction
    out["floor"] = sum(len({t.dst for t in s}) + len({t.src for t in r})
                       for s, r in plan.rank_buckets(rank))
    return out


def _mixed_rank(rank, world):
    """Rank 1 out of step with its peers (see the test): every rank must raise, twice."""
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.placement import gen_placement, train_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import build_specs
    from hybridrl.rollout.engine_sync import Coalescing, sync_engine
    from tests.distributed.test_engine_inplace import _engine
    from tests.unit.test_reshard_oracle import PAD, SMALL, make_hf, megatron_shards

    tl = TrainLayout(world, tp=2, pp=2)
    train = train_placement(tl, SMALL)
    gen = gen_placement(tl, SMALL, 2, 1, "hybridflow", vocab_pad=None)
    plan = plan_reshard(train, gen, build_specs(SMALL), "zero_redundancy", itemsize=4)
    b, a, _ = train.coords[rank]
    named = megatron_shards(SMALL, make_hf(SMALL, seed=3), 2, b, 2, a, train.vocab_chunk,
                            pad_value=PAD)
    errors = []
    engine = _engine(SMALL, gen, rank, gen.vocab_chunk)
    try:
        sync_engine(plan, rank, SMALL, named, engine, torch.float32, alias=True,
                    coalescing=None if rank == 1 else Coalescing())
    except ValueError as e:
        errors.append(str(e))
    # all agree; then rank 1 starts over with a fresh state while its peers replay
    states = Coalescing()
    sync_engine(plan, rank, SMALL, named, engine, torch.float32, alias=True, coalescing=states)
    try:
        sync_engine(plan, rank, SMALL, named, engine, torch.float32, alias=True,
                    coalescing=Coalescing() if rank == 1 else states)
    except ValueError as e:
        errors.append(str(e))
    # a first merged sync where rank 2's tensor disagrees with the plan: every rank raises the
    # same line naming it, before any message (was: rank 2 alone failed, its peers waited)
    bad = dict(named)
    name = next(iter(bad))
    if rank == 2:
        bad[name] = bad[name][:-1].clone()
    try:
        sync_engine(plan, rank, SMALL, bad, _engine(SMALL, gen, rank, gen.vocab_chunk),
                    torch.float32, alias=True, coalescing=Coalescing())
    except ValueError as e:
        errors.append((name, str(e)))
    return errors


def _all(rank, world):
    return {"cases": {c: _case_rank(rank, world, *c) for c in CASES},
            "mixed": _mixed_rank(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_all, 4, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_merged_sync_equals_the_engine_format_load(results, case):
    for rank, per in enumerate(results):
        r = per["cases"][case]
        assert [r[f"bad{s}"] for s in range(4)] == [[]] * 4, (rank, r)
        # merging adds only the small holes it runs through
        assert {r[f"received{s}"] for s in range(4)} == {r["received_plain"] + r["holes"][1]}
        assert r["holes"][1] <= 16 * 4 * r["agreed"][1], rank  # at most one 16-element hole each


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_back_to_back_transfers_travel_as_one_message(results, case):
    for rank, per in enumerate(results):
        r = per["cases"][case]
        merged, transfers = r["agreed"]
        assert r["messages_plain"] == transfers  # without merging: one message per transfer
        assert r["messages0"] == r["messages1"] == merged
        if transfers:  # reverse order with holes on the sender still merges runs: near the
            # floor of one message per bucket and peer (a tensor cut at a bucket's end costs one)
            assert merged < transfers / 2 and merged <= 2 * r["floor"], (rank, r)
        assert r["temp0"] == r["temp1"] == 0  # zero-copy on both sides
        # the second sync (same memory, new values) replays the first: bit-identical above
        assert [r[f"replayed{s}"] for s in range(4)] == [False, True, False, False], rank
        # memory moved under the agreement: same messages, packed / unpacked (and not replayed)
        assert r["messages2"] == r["messages3"] == merged
        if merged < transfers:
            assert r["temp2"] > 0 and r["temp3"] > 0, rank


@pytest.mark.slow
def test_a_rank_out_of_step_fails_every_rank(results):
    """Without merging while the peers merge, or agreeing afresh while they run their agreed
    messages: every rank raises (instead of posting unmatched messages and hanging)."""
    errors = [per["mixed"] for per in results]
    assert all(len(e) == 3 and all("disagree" in x for x in e[:2]) for e in errors), errors
    lines = {e[2][1] for e in errors}  # a wrong shape on rank 2: one line, every rank,
    line = lines.pop()  # naming rank 2's tensor and both shapes
    assert not lines and "group rank 2" in line and f"'{errors[2][2][0]}'" in line, errors
