"""The SGLang adapter on 4 gloo ranks with two gen-TP groups of 2, driven through the real
reshard into a fake Engine that has the pinned release's signatures (tests/support/
sglang_fake.py). Checked: placement (base_gpu_id/gpu_id_step/ports), that each fake scheduler
rank holds exactly its own engine-format shard (the independent oracle ``engine_shards``)
after two syncs, the call order resume -> update -> flush -> generate -> release, one
sampling-params entry per request with distinct, reproducible seeds and the stop id, that the
rounds match across ranks, and that an engine failing to start makes every rank raise the same
line. Memory, on two layouts (train tp 2, pp 2, whose local copies complete half of each gen
shard, and train tp 4, pp 1, where every matrix is half local and half received): every round,
the first included, holds at most a bucket plus the largest tensor, and the assembler's live
bytes stay within 2 buckets (plus the comm buffers of the two buckets in flight), while the
shard spans many (before the local copies were scheduled, the first round held about half the
shard, and the assembler up to nearly all of it).
"""

from __future__ import annotations

import types

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks

BUCKET_MB = 0.02
ROLLOUT = types.SimpleNamespace(engine_kwargs={"mem_fraction_static": 0.25},
                                engine_start_timeout_s=120.0, engine_port_base=30000,
                                mem_fraction_static=0.5, timeout_s=120.0, deterministic=False)


def _setup(rank, world, t, p):
    """(train, gen, plan, members of every gen-TP group, this rank's handle): gen tp 2, pp 1."""
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.placement import gen_placement, train_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import build_specs
    from hybridrl.rollout.sglang.adapter import build_sglang_engine
    from tests.support.sglang_fake import fake_backend
    from tests.unit.test_reshard_oracle import SMALL

    tl = TrainLayout(world, tp=t, pp=p)
    train = train_placement(tl, SMALL)
    gen = gen_placement(tl, SMALL, 2, 1, "hybridflow", vocab_pad=64)
    plan = plan_reshard(train, gen, build_specs(SMALL), "zero_redundancy", BUCKET_MB, 4)
    all_members = [[gen.rank_at(b, 0, rep) for b in range(2)] for rep in range(world // 2)]
    handle = build_sglang_engine("hf/", shape=SMALL, all_members=all_members, rank=rank,
                                 device="cpu", dtype=torch.float32, rollout=ROLLOUT,
                                 backend=fake_backend())
    return train, gen, plan, all_members, handle


def _sglang_rank(rank, world):
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.sglang.adapter import build_sglang_engine
    from hybridrl.rollout.worker import sync_engine
    from tests.support.sglang_fake import FailingEngine, fake_backend
    from tests.unit.test_reshard_oracle import PAD, SMALL, engine_shards, make_hf, megatron_shards

    # train tp 2, pp 2 -> gen tp 2, pp 1: two replicas (micro-DP groups of 2)
    train, gen, plan, all_members, handle = _setup(rank, world, 2, 2)
    b, a, _ = train.coords[rank]
    out = {"members": handle.members, "rounds": [], "peaks": []}
    for seed in (3, 4):  # two syncs with different weights: the second overwrites the first
        hf = make_hf(SMALL, seed=seed)
        named = megatron_shards(SMALL, hf, 2, b, 2, a, train.vocab_chunk, pad_value=PAD)
        stats = sync_engine(plan, rank, SMALL, named, handle, torch.float32)
        out["rounds"].append(handle.pusher.rounds)
        out["peaks"].append((list(handle.pusher.round_bytes), stats))
        prompts = [[5, 6, 7]] * 3 + [[8, 9]] * 3  # two prompts, n = 3 samples each
        params = SamplingParams(max_new_tokens=2, temperature=1.0, eos_token_id=2, seed=11)
        gen_out = handle.generate(prompts, params)
        again = handle.generate(prompts, params)
        handle.release()
    gb, ga, _ = gen.coords[rank]
    out["want"] = engine_shards(SMALL, hf, 2, gb, 1, ga, gen.vocab_chunk)
    out["shard_bytes"] = sum(t.numel() * t.element_size() for t in out["want"].values())
    out["largest"] = max(t.numel() * t.element_size() for t in out["want"].values())
    out["same_outputs"] = torch.equal(gen_out.response_ids, again.response_ids)
    out["gen_ids"] = gen_out.response_ids
    if handle.is_src:
        eng = handle.engine
        out["engine"] = {"args": eng.server_args, "calls": eng.calls, "loaded": eng.loaded,
                         "requests": eng.requests, "pushed": eng.pushed_names,
                         "flush_timeouts": eng.flush_timeouts}
    try:  # an engine that fails to start: every rank raises the same line
        build_sglang_engine("hf/", shape=SMALL, all_members=all_members, rank=rank,
                            device="cpu", dtype=torch.float32, rollout=ROLLOUT,
                            backend=fake_backend(FailingEngine))
        out["start_error"] = None
    except RuntimeError as err:
        out["start_error"] = str(err)
    out.update(_balanced_start(rank, all_members))
    return out


def _balanced_start(rank, all_members):
    """Issue 37 items 1-2: every member empties its cache and reports its free memory before any
    engine starts (the source's engine sees every member's mark); the start-up line lists
    them; a group whose free memory differs by more than 10 % is refused on every rank; the
    source's release line says what the first release gave back (warning when memory stayed)."""
    import dataclasses
    import os
    import tempfile
    from pathlib import Path

    from hybridrl.rollout.sglang.adapter import build_sglang_engine
    from tests.support.sglang_fake import FakeEngine, fake_backend
    from tests.unit.test_reshard_oracle import SMALL

    marks = Path(tempfile.gettempdir()) / f"hybridrl_sglang_free_{os.environ['MASTER_PORT']}"
    marks.mkdir(exist_ok=True)
    out = {}
    cases = (("balanced", [70.0, 66.0, 71.0, 65.0], 0.0), ("unbalanced", [70, 60, 70, 70], 0.0),
             ("graphs_stay", [70, 70, 70, 70], 2.0))
    for case, gib, kept in cases:
        used = [0.0]  # GiB the "engine" holds on this rank's GPU

        def measured(device, case=case, gib=gib, used=used):
            (marks / f"{case}{rank}").write_text("")
            return int((gib[rank] - used[0]) * 2**30)

        class Marked(FakeEngine):
            def __init__(self, used=used, **kwargs):
                super().__init__(**kwargs)
                self.seen = sorted(os.listdir(marks))
                used[0] = 10.0  # weights, KV pool and graphs

            def release_memory_occupation(self, tags=None, used=used, kept=kept):
                super().release_memory_occupation(tags)
                used[0] = kept  # what the memory saver did not cover stays

        backend = dataclasses.replace(fake_backend(Marked), free_memory=measured)
        try:
            h = build_sglang_engine("hf/", shape=SMALL, all_members=all_members, rank=rank,
                                    device="cpu", dtype=torch.float32, rollout=ROLLOUT,
                                    backend=backend)
            out[case] = {"line": h.start_line, "seen": h.engine.seen if h.is_src else None,
                         "release": h.release_line}
        except RuntimeError as err:
            out[case] = {"error": str(err)}
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_sglang_rank, 4, timeout=300)


@pytest.mark.slow
def test_engines_placed_per_gen_tp_group(results):
    srcs = {r["members"][0] for r in results}
    assert len(srcs) == 2 and all("engine" in results[s] for s in srcs)
    for s in srcs:
        args = results[s]["engine"]["args"]
        members = results[s]["members"]
        assert args["tp_size"] == 2 and args["base_gpu_id"] == members[0]  # LOCAL_RANK = rank
        assert args["gpu_id_step"] == members[1] - members[0]
        assert args["port"] == 30000 + 16 * members[0] and args["nccl_port"] == args["port"] + 1
        assert args["load_format"] == "dummy" and args["enable_memory_saver"]
        assert args["mem_fraction_static"] == 0.25 and args["dtype"] == "float32"  # kwargs win
        assert args["enable_deterministic_inference"] is False  # opt-in
        # SGLang's launch phase gets the adapter's SIGQUIT handler, naming this engine
        assert args["custom_sigquit_handler"].__self__.label == (
            f"rank {s}: the SGLang engine of gen-TP group {members} (source rank {s})")
    ports = [results[s]["engine"]["args"]["port"] for s in srcs]
    assert len(set(ports)) == 2


@pytest.mark.slow
def test_each_scheduler_rank_holds_exactly_its_shard(results):
    from tests.unit.test_reshard_oracle import mismatches

    for s in {r["members"][0] for r in results}:
        eng = results[s]["engine"]
        for tp_rank, member in enumerate(results[s]["members"]):
            want = results[member]["want"]
            assert set(eng["loaded"][tp_rank]) == set(want)
            assert mismatches(eng["loaded"][tp_rank], want) == []
        names = [n for _, n in eng["pushed"]]
        assert len(names) == 2 * 2 * len(results[s]["want"])  # each tensor once per rank per sync


@pytest.mark.slow
def test_call_order_and_sessions(results):
    for s in {r["members"][0] for r in results}:
        calls = results[s]["engine"]["calls"]
        assert calls[0] == "release_memory_occupation"  # started, then memory given back
        step = []
        for c in calls[1:]:
            if not step or step[-1] != c or c != "update_weights_from_tensor":
                step.append(c)
        one = ["resume_memory_occupation:weights", "begin_weight_update",
               "update_weights_from_tensor", "end_weight_update",
               "resume_memory_occupation:kv_cache,cuda_graph", "flush_cache", "generate",
               "generate", "flush_cache", "release_memory_occupation"]
        assert step == one + one, step
        # the flush before each release waits for idle, bounded by half of rollout.timeout_s
        assert results[s]["engine"]["flush_timeouts"] == [60.0] * 4


def _partial_rank(rank, world):
    """Train tp 4 -> gen tp 2: each matrix half local, half received. One sync."""
    from hybridrl.rollout.worker import sync_engine
    from tests.unit.test_reshard_oracle import PAD, SMALL, engine_shards, make_hf, megatron_shards

    train, gen, plan, _, handle = _setup(rank, world, 4, 1)
    hf = make_hf(SMALL, seed=6)
    b, a, _ = train.coords[rank]
    named = megatron_shards(SMALL, hf, 4, b, 1, a, train.vocab_chunk, pad_value=PAD)
    stats = sync_engine(plan, rank, SMALL, named, handle, torch.float32)
    gb, ga, _ = gen.coords[rank]
    want = engine_shards(SMALL, hf, 2, gb, 1, ga, gen.vocab_chunk)
    out = {"members": handle.members, "rounds": [handle.pusher.rounds], "want": want,
           "peaks": [(list(handle.pusher.round_bytes), stats)],
           "shard_bytes": sum(t.numel() * t.element_size() for t in want.values()),
           "largest": max(t.numel() * t.element_size() for t in want.values())}
    if handle.is_src:
        out["engine"] = {"loaded": handle.engine.loaded}
    return out


@pytest.fixture(scope="module")
def partial():
    return run_on_ranks(_partial_rank, 4, timeout=300)


def _check_rounds_and_memory(results):
    rounds = [r["rounds"] for r in results]
    assert all(x == rounds[0] for x in rounds), rounds  # the same rounds on every rank
    bucket = int(BUCKET_MB * 2**20)
    for r in results:
        assert r["shard_bytes"] > 4 * bucket  # the shard spans many buckets ...
        for per_round, stats in r["peaks"]:
            assert sum(per_round) == r["shard_bytes"]  # every tensor pushed once, in rounds
            # ... every round, the first (local copies) included, holds about one bucket
            assert 0 < max(per_round) <= bucket + r["largest"], (per_round, bucket, r["largest"])
            assert per_round[0] <= bucket + r["largest"], per_round
            assert stats.peak_assembler_bytes <= 2 * bucket, (stats, bucket)
            assert stats.peak_live_bytes <= 2 * bucket + stats.peak_comm_bytes, (stats, bucket)


@pytest.mark.slow
def test_rounds_matched_and_memory_bounded(results):
    _check_rounds_and_memory(results)


@pytest.mark.slow
def test_partly_local_parameters_bounded_and_exact(partial):
    from tests.unit.test_reshard_oracle import mismatches

    _check_rounds_and_memory(partial)
    for s in {r["members"][0] for r in partial}:
        loaded = partial[s]["engine"]["loaded"]
        for tp_rank, member in enumerate(partial[s]["members"]):
            assert mismatches(loaded[tp_rank], partial[member]["want"]) == []


@pytest.mark.slow
def test_sampling_params_per_request_with_distinct_seeds(results):
    for s in {r["members"][0] for r in results}:
        reqs = results[s]["engine"]["requests"]
        ids, sp, logprob = reqs[0]
        assert logprob is True and len(sp) == len(ids) == 6
        seeds = [p["sampling_seed"] for p in sp]
        assert len(set(seeds)) == 6  # the 3 samples of each prompt differ
        assert all(p["stop_token_ids"] == [2] and p["max_new_tokens"] == 2 for p in sp)
        assert [p["sampling_seed"] for p in reqs[1][1]] == seeds  # reproducible
    for r in results:
        assert r["same_outputs"]
        assert torch.equal(r["gen_ids"], results[r["members"][0]]["gen_ids"])  # broadcast


@pytest.mark.slow
def test_engine_starts_after_every_member_measured_its_free_memory(results):
    for r in results:
        res, members = r["balanced"], r["members"]
        assert res["line"].startswith(f"SGLang engine of gen-TP group {members}: free GPU "
                                      f"memory at start rank {members[0]} ")
        if res["seen"] is not None:  # the source: its engine started after every member's mark
            assert {f"balanced{m}" for m in members} <= set(res["seen"]), res["seen"]
    line = results[0]["balanced"]["line"]
    assert "rank 0 70.0 GiB, rank 1 66.0 GiB" in line
    # the source checks what its first release gave back (graphs under the memory saver)
    assert results[0]["balanced"]["release"] == ("SGLang engine of gen-TP group [0, 1]: took "
                                                 "10.0 GiB of the source GPU at start, gave "
                                                 "back 10.0 GiB on release")
    assert results[0]["graphs_stay"]["release"].endswith(
        "gave back 8.0 GiB on release: 2.0 GiB stayed on the GPU through training (CUDA graphs "
        "outside the memory saver? SGLANG_MEMORY_SAVER_CUDA_GRAPH)")
    assert results[1]["balanced"]["release"] == ""  # only the source measures its engine
    errors = {r["unbalanced"].get("error") for r in results}
    assert len(errors) == 1  # the same line on every rank, the other group's ranks included
    (error,) = errors
    assert error.startswith("rank 0: the SGLang engine failed to start: RuntimeError: free GPU "
                            "memory differs by more than 10% across gen-TP group [0, 1] "
                            "(rank 0 70.0 GiB, rank 1 60.0 GiB)"), error


@pytest.mark.slow
def test_failed_start_raises_the_same_line_everywhere(results):
    errors = {r["start_error"] for r in results}
    assert len(errors) == 1
    (line,) = errors
    assert line.startswith("rank 0: the SGLang engine failed to start: RuntimeError: CUDA out")
    assert "\n" not in line
