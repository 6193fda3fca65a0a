"""The agent loop's continuation on 2 gen-TP ranks (gloo, one launch): the builtin engine at
gen TP 2 continues each sequence from its kept K/V (every rank keeps its half of the heads)
and gives the tails, loss masks and statistics of resending whole contexts, log-probs within
1e-5, with the real calculator, the plain format and the tool outputs shared from the source
rank; the engine prefills exactly the unique prompts, the tool segments and each continued
turn's last model token; both ranks return the same. The model, budgets and seeds are those of
tests/unit/test_builtin_prefix_cache.py (gen TP 1 there), including rounds split by the
engine's ``max_seq_len``.
"""

from __future__ import annotations

import torch

from hybridrl.testing.dist import run_on_ranks


def _rank(rank, world):
    import torch.distributed as dist

    from tests.unit.test_builtin_prefix_cache import BUDGET, PROMPTS, _loop_run, bigram_llama
    from tests.unit.test_rollout import engine_from_hf

    def share(objects):
        box = [objects]
        dist.broadcast_object_list(box, src=0, group=dist.group.WORLD)
        return box[0]

    model = bigram_llama(4)
    out = {}
    for continuation in (True, False):
        engine = engine_from_hf(model, tp=world, tp_rank=rank, tp_group=dist.group.WORLD,
                                tp_src=0)
        res, calls, prompts = _loop_run(engine, continuation, max(map(len, PROMPTS)) + BUDGET,
                                        share)
        out[continuation] = (res.response_ids, res.response_mask, res.logprobs, res.loss_mask,
                             res.stats, calls, engine.prefilled)
    out["unique"] = sum(len(p) for p in {tuple(p) for p in prompts})
    return out


def test_continuation_equals_resending_at_gen_tp_2():
    res = run_on_ranks(_rank, 2, timeout=300)
    for r in res:
        ids, mask, logp, lmask, stats, calls, prefilled = r[True]
        ids2, mask2, logp2, lmask2, stats2, calls2, prefilled2 = r[False]
        assert torch.equal(ids, ids2) and torch.equal(mask, mask2) and torch.equal(lmask, lmask2)
        torch.testing.assert_close(logp, logp2, rtol=0, atol=1e-5)
        assert stats == stats2 and calls == calls2 and len(calls) > 4, (stats, calls)
        assert stats["tool_calls"] > stats["tool_errors"] > 0 and stats["turns"] > 2 * 8, stats
        assert prefilled == (r["unique"] + stats["tool_tokens"] + stats["turns"]
                             - stats["sequences"])
        assert prefilled2 > 2 * prefilled
        assert torch.equal(ids, res[0][True][0]) and torch.equal(logp, res[0][True][2])
