"""The reshard's phase schedule (pure, no process group) and the memory bound it gives.

Checked on every layout of <= 8 ranks and every strategy that applies: each local piece is
scheduled exactly once; a piece of a parameter the rank also receives lands in the phase of the
last bucket delivering that parameter to it (recomputed here from the buckets); local-only chunks
hold at most one bucket unless they are one parameter, and a key's pieces share one chunk; L is
the most chunks of any rank (so the same for all); the planner charges a parameter's local rows
to that bucket. Then, executing single-process (``run_plan_local``): before every flush at most
a bucket plus two parameters are live (the old schedule, all local copies in one first flush,
broke this), and the assembled tensors are bit-identical to the old execution order.
"""

import itertools

import pytest
import torch

from hybridrl.parallel.layout import TrainLayout
from hybridrl.reshard.assemble import Assembler
from hybridrl.reshard.executor import _piece, run_plan_local, train_sources
from hybridrl.reshard.formats import build_format
from hybridrl.reshard.placement import gen_placement, train_placement
from hybridrl.reshard.planner import STRATEGIES, Transfer, plan_reshard
from hybridrl.reshard.schedule import local_chunks, local_phases, phase_schedule
from hybridrl.reshard.specs import build_specs
from tests.unit.test_reshard_oracle import PAD, SMALL, make_hf, megatron_shards

BUCKET_MB = 0.01


def _div(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def _plan(w, t, p, tg, pg, strategy, vocab_pad=None):
    tl = TrainLayout(w, tp=t, pp=p)
    nested = t % tg == 0 and p % pg == 0
    grouping = "vanilla" if strategy == "vanilla" else ("hybridflow" if nested else "consecutive")
    gen = gen_placement(tl, SMALL, tg, pg, grouping, vocab_pad=vocab_pad)
    return plan_reshard(train_placement(tl, SMALL), gen, build_specs(SMALL), strategy,
                        bucket_mb=BUCKET_MB, itemsize=4)


def _splits(w):
    """(tp, pp) with tp * pp | w that megatron can cut SMALL into."""
    return [(t, p) for t, p in itertools.product(_div(w), _div(w))
            if w % (t * p) == 0 and SMALL.num_query_groups % t == 0 and SMALL.ffn % t == 0
            and SMALL.layers % p == 0]


def _plans(max_world=8):
    for w in range(1, max_world + 1):
        for (t, p), (tg, pg) in itertools.product(_splits(w), _splits(w)):
            nested = t % tg == 0 and p % pg == 0
            for strategy in STRATEGIES:
                if strategy in ("zero_redundancy", "vanilla") and not nested:
                    continue
                yield (w, t, p, tg, pg, strategy), _plan(w, t, p, tg, pg, strategy)


def _nbytes(plan, pieces):
    return sum((hi - lo) * plan.spec(k).row_numel * plan.itemsize for k, lo, hi in pieces)


def _per_rank(plan):
    """Per rank, recomputed from the buckets: last bucket delivering each key, buckets it takes
    part in, and bytes received / sent per bucket."""
    world = plan.train.world
    last = [{} for _ in range(world)]
    own = [[] for _ in range(world)]
    recv = [{} for _ in range(world)]  # rank -> bucket -> [receive bytes]
    sent = [{} for _ in range(world)]
    for k, bucket in enumerate(plan.buckets):
        for t in bucket:
            last[t.dst][t.key] = k
            recv[t.dst].setdefault(k, []).append(t.nbytes)
            sent[t.src].setdefault(k, []).append(t.nbytes)
            for r in (t.src, t.dst):
                if not own[r] or own[r][-1] != k:
                    own[r].append(k)
    return last, own, recv, sent


def test_schedule_places_every_local_piece_once_and_buckets_are_charged_for_it():
    cases = 0
    for case, plan in _plans():
        cases += 1
        world = plan.train.world
        n = local_phases(plan)
        assert n == max([1] + [len(local_chunks(plan, r)) for r in range(world)]), case
        last, own, recv, sent = _per_rank(plan)
        for r in range(world):
            s = phase_schedule(plan, r)
            assert len(s.local) == n and s.buckets == tuple(sorted(set(own[r]))), case
            assert s.phases == tuple(range(-n, 0)) + s.buckets, case
            got = [x for c in s.local for x in c] + [x for v in s.at_bucket.values() for x in v]
            assert sorted(got) == sorted(plan.locals[r]), case  # each piece exactly once
            for k, pieces in s.at_bucket.items():  # with the last bucket delivering its key
                assert all(last[r][key] == k for key, _, _ in pieces), (case, r, k)
            chunks = [c for c in s.local if c]
            assert list(s.local[:len(chunks)]) == chunks, case  # empty phases come last
            seen = set()
            for c in chunks:
                keys = {key for key, _, _ in c}
                assert not keys & set(last[r]) and not keys & seen, (case, r)  # one chunk per key
                seen |= keys
                assert _nbytes(plan, c) <= plan.bucket_bytes or len(keys) == 1, (case, r)
            for k, sizes in recv[r].items():  # the planner charged the local rows there
                charge = sum(sizes) + _nbytes(plan, s.at_bucket.get(k, ()))
                assert charge <= plan.bucket_bytes or len(sizes) == 1, (case, r, k)
            for k, sizes in sent[r].items():
                assert sum(sizes) <= plan.bucket_bytes or len(sizes) == 1, (case, r, k)
    assert cases > 300


def _old_order(plan, sources, asms):
    """The schedule before: every local copy in one first flush, then the buckets."""
    for r, asm in enumerate(asms):
        for key, lo, hi in plan.locals[r]:
            asm.accept(key, lo, hi, _piece(plan, sources[r], Transfer(key, r, r, lo, hi, 0)))
        asm.flush()
    for bucket in plan.buckets:
        for t in bucket:
            asms[t.dst].accept(t.key, t.lo, t.hi, _piece(plan, sources[t.src], t).clone())
        for asm in asms:
            asm.flush()


@pytest.mark.parametrize("case", [
    (4, 2, 2, 2, 1, "zero_redundancy"), (4, 4, 1, 2, 1, "zero_redundancy"),
    (4, 2, 1, 1, 1, "zero_redundancy"), (8, 2, 2, 1, 1, "zero_redundancy"),
    (8, 4, 2, 2, 1, "p2p"), (4, 2, 2, 4, 1, "p2p"), (8, 2, 1, 8, 1, "p2p"),
    (4, 2, 2, 1, 1, "vanilla"), (4, 2, 1, 1, 1, "allgather"),
])
def test_flushes_stay_near_one_bucket_and_results_match_the_old_order(case):
    w, t, p, tg, pg, strategy = case
    plan = _plan(w, t, p, tg, pg, strategy, vocab_pad=64)
    hf = make_hf(SMALL, seed=5)
    sources, fmts = [], []
    for r in range(w):
        b, a, _ = plan.train.coords[r]
        named = megatron_shards(SMALL, hf, t, b, p, a, plan.train.vocab_chunk, pad_value=PAD)
        sources.append(train_sources(plan, r, named))
        fmts.append(build_format("engine", SMALL, plan.gen, r))
    sinks = [Assembler(plan, r, fmts[r], sink=lambda named: None) for r in range(w)]
    peaks = run_plan_local(plan, sources, sinks)
    for r in range(w):  # live: a bucket, the rows of a parameter begun before, one opened after
        dest = [_nbytes(plan, [(k, *iv)]) for k, iv in plan.dests[r].items()]
        assert 0 < peaks[r] <= plan.bucket_bytes + 2 * max(dest), (r, peaks[r], max(dest))
        assert peaks[r] < sum(dest) / 2, (r, peaks[r], sum(dest))  # never much of the shard
    new = [Assembler(plan, r, fmts[r]) for r in range(w)]
    old = [Assembler(plan, r, fmts[r]) for r in range(w)]
    run_plan_local(plan, sources, new)
    _old_order(plan, sources, old)
    for r in range(w):
        got, want = new[r].result(), old[r].result()
        assert set(got) == set(want) and len(want) > 0
        assert all(torch.equal(got[k], want[k]) for k in want), r
