"""The builtin engine on 2 gen-TP ranks (gloo) against transformers' LlamaForCausalLM.

Each rank loads its engine-format shard (cut from the HF tensors by the independent oracle
``engine_shards``: half the heads, half the FFN, half the padded vocabulary), so every forward
runs the TP all-reduces and the vocab all-gather. Checked in the parent against one process of
transformers: last-position logits of every prompt (1e-5), greedy tokens and their log-probs,
sampled tokens' log-probs at temperature 0.8 (top-k/top-p on) against the HF recompute, and that
both TP ranks return the same responses; ``RolloutWorker._handoff`` (the hand-off of
``generate``, one part holding every row) assembles shares of different sizes and response lengths
(and ranks that send nothing) in prompt order, the same on every rank, from int32 ids + fp32
log-probs of the valid tokens only.
The engine-vs-megatron-actor log-prob check on 2 ranks
(through the real reshard) lives in test_trainer.py (``training/rollout_logprob_diff``).
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks
from tests.unit.test_rollout import PROMPTS, engine_from_hf, hf_greedy, tiny_hf


def _engine_rank(rank, world, state, config):
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridrl.rollout.base import SamplingParams

    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(state)
    engine = engine_from_hf(model, tp=world, tp_rank=rank, tp_group=dist.group.WORLD, tp_src=0)
    prompts = [torch.tensor(p) for p in PROMPTS]
    logits = []
    for p in prompts:  # prefill only: last-position logits over the full vocabulary
        ids = p.unsqueeze(0)
        pos = torch.arange(len(p)).unsqueeze(0)
        allowed = torch.ones(1, len(p), len(p), dtype=torch.bool).tril()
        h = engine.forward(ids, pos, engine._new_cache(1, len(p)), 0, allowed)
        logits.append(engine.logits(h[:, -1])[0])
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    sampled = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.8,
                                                      top_k=30, top_p=0.95, seed=7))
    return {"logits": torch.stack(logits), "greedy": greedy, "sampled": sampled}


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_two_gen_tp_ranks_match_transformers(tied):
    model = tiny_hf(tied)
    config = model.config.to_dict()
    config = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "vocab_size",
                                     "max_position_embeddings", "tie_word_embeddings",
                                     "rms_norm_eps")}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    res = run_on_ranks(_engine_rank, 2, state, config, timeout=200)
    for r in res:
        for b, prompt in enumerate(PROMPTS):
            with torch.no_grad():
                want = model(torch.tensor([prompt])).logits[0, -1].float()
            torch.testing.assert_close(r["logits"][b], want, atol=1e-5, rtol=0)
            toks, logps = hf_greedy(model, prompt, 6)
            assert r["greedy"].response_ids[b].tolist() == toks
            torch.testing.assert_close(r["greedy"].logprobs[b], torch.tensor(logps), atol=1e-5,
                                       rtol=0)
            out = r["sampled"]
            seq = torch.tensor([prompt + out.response_ids[b].tolist()])
            with torch.no_grad():
                logp = torch.log_softmax(model(seq).logits[0].float() / 0.8, -1)
            want_lp = logp[len(prompt) - 1:-1].gather(-1, out.response_ids[b][:, None])[:, 0]
            torch.testing.assert_close(out.logprobs[b], want_lp, atol=1e-5, rtol=0)
    for key in ("greedy", "sampled"):
        assert torch.equal(res[0][key].response_ids, res[1][key].response_ids)
        assert torch.equal(res[0][key].logprobs, res[1][key].logprobs)


class _BufferingEngine:
    """An engine without ``start_update`` that buffers in ``update_weights`` and gathers the
    buffers once in ``finish_update`` (payload = the tensors themselves): the sink protocol
    every such engine relies on (the SGLang push, with rounds, is tests/distributed/
    test_sglang.py)."""

    def __init__(self, tp_group, tp_src, tp_size):
        self.group, self.src, self.tp_size, self.pending = tp_group, tp_src, tp_size, []
        self.n_update = self.n_finish = 0
        self.comm_in_update = 0
        self.mine, self.gathered = {}, None

    def update_weights(self, named_tensors):
        before = _COLLECTIVES[0]
        named = list(named_tensors)
        self.mine.update((n, t.clone()) for n, t in named)
        self.pending.extend(named)
        self.n_update += 1
        self.comm_in_update += _COLLECTIVES[0] - before

    def finish_update(self):
        import torch.distributed as dist

        self.n_finish += 1
        payload, self.pending = {n: t.clone() for n, t in self.pending}, []
        is_src = dist.get_rank() == self.src
        self.gathered = [None] * self.tp_size if is_src else None
        dist.gather_object(payload, self.gathered, dst=self.src, group=self.group)


_COLLECTIVES = [0]  # gather_object calls on this rank (patched in _sync_rank)


def _sync_rank(rank, world):
    """sync_engine (RolloutWorker.sync_weights' body) on a gen TP group of 2 whose ranks flush
    different numbers of buckets: one gather per sync, none inside update_weights."""
    import torch.distributed as dist

    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.placement import gen_placement, train_placement
    from hybridrl.reshard.planner import plan_reshard
    from hybridrl.reshard.specs import build_specs
    from hybridrl.rollout.worker import sync_engine
    from tests.unit.test_reshard_oracle import PAD, SMALL, engine_shards, make_hf, megatron_shards

    real_gather = dist.gather_object

    def counting_gather(*args, **kwargs):
        _COLLECTIVES[0] += 1
        return real_gather(*args, **kwargs)

    dist.gather_object = counting_gather
    tl = TrainLayout(world, tp=1, pp=2)  # gen tp=2 does not nest: consecutive grouping, p2p
    train = train_placement(tl, SMALL)
    gen = gen_placement(tl, SMALL, 2, 1, "consecutive", vocab_pad=64)
    plan = plan_reshard(train, gen, build_specs(SMALL), "p2p", bucket_mb=0.005, itemsize=4)
    hf = make_hf(SMALL, seed=3)
    b, a, _ = train.coords[rank]
    named = megatron_shards(SMALL, hf, 1, b, 2, a, train.vocab_chunk, pad_value=PAD)
    engine = _BufferingEngine(dist.group.WORLD, 0, world)
    out = []
    for _ in range(2):  # two syncs: one gather each
        sync_engine(plan, rank, SMALL, named, engine, torch.float32)
        out.append((engine.n_update, engine.n_finish, _COLLECTIVES[0], engine.comm_in_update))
    gb, ga, _ = gen.coords[rank]
    want = engine_shards(SMALL, hf, 2, gb, 1, ga, gen.vocab_chunk)
    return {"counts": out, "mine": engine.mine, "gathered": engine.gathered, "want": want}


@pytest.mark.slow
def test_sync_gathers_once_per_sync_on_every_rank():
    from tests.unit.test_reshard_oracle import mismatches

    res = run_on_ranks(_sync_rank, 2, timeout=200)
    n_update = [r["counts"][0][0] for r in res]
    assert n_update[0] != n_update[1], n_update  # the case that hung: unequal flush counts
    for r in res:
        (u1, f1, c1, x1), (u2, f2, c2, x2) = r["counts"]
        assert (f1, c1, x1) == (1, 1, 0) and (f2, c2, x2) == (2, 2, 0), r["counts"]
        assert u2 == 2 * u1 > 0
        assert mismatches(r["mine"], r["want"]) == []
    assert res[1]["gathered"] is None
    for src_rank, payload in enumerate(res[0]["gathered"]):
        assert mismatches(payload, res[src_rank]["want"]) == []


def _gen_tp_rank(rank, world):
    """The worker's gen TP group: reused from build_groups when the gen layout is the same,
    else created once per gen TP group with a finite timeout."""
    import torch.distributed as dist

    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import GenLayout, TrainLayout
    from hybridrl.reshard.placement import gen_placement
    from hybridrl.rollout.worker import _gen_tp_groups
    from tests.unit.test_reshard_oracle import SMALL

    created = []
    real_new_group = dist.new_group

    def recording_new_group(ranks=None, **kwargs):
        created.append((list(ranks), kwargs.get("timeout")))
        return real_new_group(ranks, **kwargs)

    train = TrainLayout(world, tp=2)
    nested = build_groups(train, GenLayout(train, tp=2))
    plain = build_groups(train)
    dist.new_group = recording_new_group
    gen = gen_placement(train, SMALL, 2, 1, "hybridflow")
    group, members = _gen_tp_groups(gen, rank, nested, "hybridflow")
    reused = (group is nested.groups["gen_tp"], members, list(created))
    group, members = _gen_tp_groups(gen, rank, plain, "hybridflow")
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t, group=group)  # the new group works
    dist.new_group = real_new_group
    fresh = (members, [(r, to.total_seconds() if to else None) for r, to in created], float(t))
    return {"reused": reused, "fresh": fresh, "gathered": _gather_case(rank)}


def _share(rows, R):
    """A replica's GenerationOutput for prompt rows ``rows``: distinct ids, masks, log-probs."""
    from hybridrl.rollout.base import GenerationOutput

    n = len(rows)
    ids = torch.arange(n * R, dtype=torch.long).reshape(n, R) + 1000 * torch.tensor(rows)[:, None]
    mask = (torch.arange(R)[None, :] < (torch.arange(n)[:, None] % R) + 1).long()
    return GenerationOutput(ids, mask, -(ids % 7).float() / 7)


SHARES = {0: ([0, 1, 2], 3), 1: ([3, 4], 2)}  # rank -> (prompt rows, response length)
ONE_REPLICA = ([0, 1, 2, 3, 4], 3)


def _gather_case(rank):
    """RolloutWorker._handoff on 2 ranks, every row to both: shares of 3 and 2 prompts with
    responses of different lengths, then the same with rank 1 not a gen TP source (it sends 0
    rows)."""
    import types

    from hybridrl.rollout.worker import RolloutWorker

    # the hand-off alone: the engines' store wait and the bounded collective wait are
    # tests/distributed/test_sglang_timeouts.py's
    out = {}
    # both: 2 replicas of gen tp 1 (rank r generates SHARES[r]); only0: one replica of gen tp 2
    # (both ranks generate every row, rank 0 is its source, rank 1 sends nothing)
    for key, src, n_rep, (rows, R) in (("both", True, 2, SHARES[rank]),
                                       ("only0", rank == 0, 1, ONE_REPLICA)):
        fake = types.SimpleNamespace(device=torch.device("cpu"), pad_token_id=-1, rank=rank,
                                     is_src=src, n_replicas=n_rep,
                                     gen=types.SimpleNamespace(rank_at=lambda b, p, rep: rep),
                                     _await_engines=lambda what: None,
                                     _bounded=lambda work, what: work.wait())
        _, out[key], stats = RolloutWorker._handoff(fake, 5, rows, _share(rows, R),
                                                    lambda lens: [list(range(5))], [[0, 1]])
        out[key + "_bytes"] = stats.bytes_in
    return out


def _expected(shares):
    ids = torch.full((5, 3), -1, dtype=torch.long)
    mask = torch.zeros(5, 3, dtype=torch.long)
    logp = torch.zeros(5, 3)
    for rows, R in shares:
        out = _share(rows, R)
        ids[rows, :R], mask[rows, :R], logp[rows, :R] = (out.response_ids, out.response_mask,
                                                         out.logprobs)
    valid = mask.bool()  # past its length a row holds the pad id and log-prob 0
    return torch.where(valid, ids, -1), mask, torch.where(valid, logp, torch.zeros_like(logp))


@pytest.fixture(scope="module")
def gen_tp_results():
    return run_on_ranks(_gen_tp_rank, 2, timeout=200)


@pytest.mark.slow
def test_gen_tp_group_reused_or_created_with_timeout(gen_tp_results):
    for res in gen_tp_results:
        assert res["reused"] == (True, [0, 1], [])
        assert res["fresh"] == ([0, 1], [([0, 1], 600.0)], 3.0)


@pytest.mark.slow
def test_generate_gathers_every_share_in_prompt_order(gen_tp_results):
    for key, shares in (("both", list(SHARES.values())), ("only0", [ONE_REPLICA])):
        want = _expected(shares)
        for res in gen_tp_results:
            got = res["gathered"][key]
            assert got.logprobs.dtype == torch.float32, key
            for g, w in zip((got.response_ids, got.response_mask, got.logprobs), want):
                assert torch.equal(g, w), key
    # what crosses: the other rank's valid tokens, 8 bytes each (no padding, no float64)
    other = [int(_share(*SHARES[1 - r]).response_mask.sum()) for r in (0, 1)]
    assert [res["gathered"]["both_bytes"] for res in gen_tp_results] == [8 * n for n in other]
    whole = int(_share(*ONE_REPLICA).response_mask.sum())
    assert [res["gathered"]["only0_bytes"] for res in gen_tp_results] == [0, 8 * whole]
