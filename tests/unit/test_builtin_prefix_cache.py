"""Builtin engine prefix reuse (hybridrl/rollout/builtin/decode.py, session.py):
- shared prefill: identical prompts of one call are prefilled once (counted at the forward) and
  every row samples what it samples with the sharing off (tokens equal, log-probs within fp32
  rounding), with per-row seeds and with the batch generator, finished rows compacted, dense
  and MoE (the copied prompt rows' expert ids included);
- sessions: a continued call prefills only the tokens appended after the kept ones (counted at
  the forward) and returns what a whole-context call returns; a prompt that does not extend
  its kept tokens reuses only the common prefix; drop frees;
- the agent loop with the real calculator and the plain format: continuation gives the tails,
  loss masks and statistics of resending whole contexts, log-probs within 1e-5, while the
  engine prefills exactly the unique prompts, the tool segments and each continued turn's
  last model token (the engine's ``max_seq_len`` splitting rounds into several calls).

The model is a tiny llama steered by a character bigram table (``bigram_llama``) so that random
sampling writes ``<c 12+3>`` calls, wrong calls and answers, on top of random attention and MLP
layers whose output shifts every log-prob with the context (a wrong K/V shows).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridrl.data.tokenizer import CharTokenizer
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.multi_turn import AgentLoop, Budgets, build_format
from hybridrl.tools import ToolRegistry
from hybridrl.tools.calculator import Calculator
from tests.unit.test_moe_engine import engine_of, tiny_moe
from tests.unit.test_rollout import engine_from_hf

TOK = CharTokenizer()
V = TOK.vocab_size
CLOSE = TOK.encode(">")[0]


class ShortCalculator(Calculator):
    name = "c"  # the real calculator under a name a bigram model writes often


def bigram_llama(seed: int = 0):
    """A 2-layer llama: character bigram logits (a call, digits, '+', '>' or eos after a
    digit) from a one-hot embedding, plus random layers writing only the other hidden dims."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                   max_position_embeddings=256, rms_norm_eps=1e-5,
                                   attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    e = {c: TOK.encode(c)[0] for c in "0123456789 <c+>"}
    digits = [e[d] for d in "0123456789"]
    table = torch.full((V, V), 1e-5)
    table[:, digits] = 0.1
    table[e[" "]] = 1e-5
    table[e[" "], e["<"]], table[e[" "], digits] = 0.2, 0.08
    table[e["<"]], table[e["c"]] = 1e-5, 1e-5
    table[e["<"], e["c"]], table[e["c"], e[" "]] = 1.0, 1.0
    for d in digits:
        table[d] = 1e-5
        table[d, digits] = 0.04
        table[d, e["+"]], table[d, e[">"]], table[d, TOK.eos_token_id] = 0.2, 0.32, 0.08
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        model.model.embed_tokens.weight[:, :V] = 4 * torch.eye(V)
        for layer in model.model.layers:
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                w[:V] = 0
                w[V:] *= 0.03
            layer.input_layernorm.weight.fill_(1)
            layer.post_attention_layernorm.weight.fill_(1)
        model.model.norm.weight.fill_(1)
        model.lm_head.weight[:, :V] = table.log().T / 3
    return model


def _counting(engine):
    """Wrap ``engine.forward``: the list of (rows, tokens) of every forward."""
    seen, forward = [], engine.forward

    def counted(ids_BS, *args, **kwargs):
        seen.append(tuple(ids_BS.shape))
        return forward(ids_BS, *args, **kwargs)

    engine.forward = counted
    return seen


def _params(B, seeds=True, n=12):
    return SamplingParams(n, eos_token_id=TOK.eos_token_id, stop_token_ids=(CLOSE,),
                          row_seeds=tuple(range(100, 100 + B)) if seeds else None, seed=5)


def _same(a, b, atol=1e-5):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)


PROMPTS = [TOK.encode(t) for t in ("q: 12+7\nassistant: ", "add 3 and 40\nassistant: ", "x ")]


def test_identical_prompts_are_prefilled_once_and_sample_as_before():
    model = bigram_llama()
    batch = [PROMPTS[i] for i in (0, 1, 0, 2, 1, 0, 2, 0, 1, 1, 0, 2)]
    for seeds in (True, False):
        on, off = engine_from_hf(model), engine_from_hf(model, share_prefill=False)
        seen_on, seen_off = _counting(on), _counting(off)
        a, b = on.generate(batch, _params(12, seeds)), off.generate(batch, _params(12, seeds))
        _same(a, b, atol=1e-6)
        P = max(map(len, PROMPTS))
        assert seen_on[0] == (3, P) and seen_off[0] == (12, P)
        assert on.prefilled == sum(map(len, PROMPTS)) and off.prefilled == sum(map(len, batch))
        assert len(seen_on) > 2 and (seen_on[-1][0] < 12)  # several steps, rows compacted
        assert a.response_mask.sum(1).min() < a.response_mask.shape[1]  # some rows stopped early
        rows = [a.response_ids[i][a.response_mask[i].bool()].tolist() for i in (0, 2, 5, 7, 10)]
        if seeds:  # the duplicates of one prompt sample under their own seeds
            assert len({tuple(r) for r in rows}) > 1


def test_identical_moe_prompts_share_their_routing_too():
    model = tiny_moe()
    on, off = engine_of(model), engine_of(model)
    off.share_prefill = False
    batch = [[5, 17, 42, 8, 9], [7, 1], [5, 17, 42, 8, 9], [7, 1], [5, 17, 42, 8, 9]]
    params = SamplingParams(6, seed=3, row_seeds=(1, 2, 3, 4, 5), eos_token_id=11)
    seen = _counting(on)
    a, b = on.generate(batch, params), off.generate(batch, params)
    _same(a, b, atol=1e-6)
    assert seen[0][0] == 2
    assert torch.equal(a.routed_experts, b.routed_experts)
    assert int((a.routed_experts[4, :4] >= 0).sum()) == 4 * 2 * 2  # the copied prompt rows
    # continued from a kept cache: the kept tokens' expert ids come back with the new ones
    params = dataclasses.replace(params, stop_token_ids=tuple(range(0, 100, 3)))
    with on.open_session() as session:
        first = session.generate(batch, params, keys=range(5))
        keys = sorted(session.rows)
        assert keys
        contexts = [batch[b] + first.response_ids[b][first.response_mask[b].bool()].tolist()
                    + [4, 6] for b in keys]
        before = on.prefilled
        again = dataclasses.replace(params, row_seeds=tuple(range(len(keys))))
        c, d = session.generate(contexts, again, keys=keys), off.generate(contexts, again)
        assert on.prefilled - before == 3 * len(keys)
        _same(c, d, atol=1e-6)
        assert torch.equal(c.routed_experts, d.routed_experts)


def _segment(fmt, out, b):
    resp = out.response_ids[b][out.response_mask[b].bool()].tolist()
    return resp, fmt.segment_ids(["1234"])


def test_a_session_prefills_only_the_appended_tokens_and_matches_a_whole_call():
    model = bigram_llama(1)
    tools = ToolRegistry([ShortCalculator()])
    fmt = build_format("plain", TOK, tools.schemas())
    kept, fresh = engine_from_hf(model), engine_from_hf(model)
    batch = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    with kept.open_session() as session:
        first = session.generate(batch, _params(4), keys=range(4))
        _same(first, fresh.generate(batch, _params(4)))
        stopped = [b for b in range(4) if first.response_ids[b][first.response_mask[b].bool()]
                   .tolist()[-1] in (CLOSE, TOK.eos_token_id)]
        assert 0 < len(stopped) and sorted(session.rows) == stopped  # cut rows keep nothing
        contexts, new = [], []
        for b in stopped:
            resp, seg = _segment(fmt, first, b)
            contexts.append(batch[b] + resp + seg)
            new.append(1 + len(seg))  # the last sampled token was never forwarded
        assert session.held_tokens() == sum(len(c) - n for c, n in zip(contexts, new))
        _held = session.rows[stopped[0]]
        seen, before = _counting(kept), kept.prefilled
        second = session.generate(contexts, _params(len(stopped)), keys=stopped)
        _same(second, fresh.generate(contexts, _params(len(stopped))))
        assert seen[0] == (len(stopped), max(new))  # the prefill forward: the new tokens only
        assert kept.prefilled - before == sum(new)
        # a prompt that leaves its kept tokens reuses only the common prefix
        other = [contexts[0][:len(batch[stopped[0]]) + 1] + TOK.encode("xyz")]  # never sampled
        session.rows[stopped[0]] = _held  # the first call's kept row of that sequence
        before = kept.prefilled
        third = session.generate(other, _params(1), keys=[stopped[0]])
        _same(third, fresh.generate(other, _params(1)))
        assert kept.prefilled - before == len(other[0]) - min(len(batch[stopped[0]]) + 1,
                                                              len(_held))
        session.drop(list(session.rows))
        assert session.held_tokens() == 0
        with pytest.raises(ValueError, match="one distinct key per prompt"):
            session.generate(batch[:2], _params(2), keys=[0, 0])


BUDGET = 128


def _loop_run(engine, continuation: bool, max_seq_len: int, share=None):
    engine.spec = dataclasses.replace(engine.spec, max_seq_len=max_seq_len)
    tools = ToolRegistry([ShortCalculator()], max_output_chars=24)
    fmt = build_format("plain", TOK, tools.schemas())
    calls = []
    run = engine._run

    def counted(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return run(prompts, *args, **kwargs)

    engine._run = counted
    loop = AgentLoop(engine, fmt, tools, Budgets(BUDGET, max_tokens_per_turn=32,
                                                 max_assistant_turns=4, max_tool_calls=4),
                     share=share, continuation=continuation)
    prompts = [PROMPTS[i] for i in (0, 0, 1, 1, 2, 2, 0, 1)]
    out = loop.run(prompts, SamplingParams(64, eos_token_id=TOK.eos_token_id,
                                           row_seeds=tuple(range(7, 15))))
    return out, calls, prompts


def test_agent_loop_continuation_equals_resending_whole_contexts():
    model = bigram_llama(4)
    longest = max(map(len, PROMPTS))
    cont_engine, resend_engine = engine_from_hf(model), engine_from_hf(model)
    cont, calls, prompts = _loop_run(cont_engine, True, longest + BUDGET)
    resend, calls_resend, _ = _loop_run(resend_engine, False, longest + BUDGET)
    _same(cont, resend, atol=1e-5)
    assert torch.equal(cont.loss_mask, resend.loss_mask) and cont.stats == resend.stats
    s = cont.stats
    assert s["turns"] > s["sequences"] and s["tool_calls"] > s["tool_errors"] > 0, s
    lm = cont.loss_mask  # rounds = the most model turns of a row (runs of model tokens)
    rounds = int(((lm[:, 1:] == 1) & (lm[:, :-1] == 0)).sum(1).add(lm[:, 0]).max())
    assert len(calls) > rounds >= 3 and calls == calls_resend  # rounds split by max_seq_len
    unique = sum(len(p) for p in {tuple(p) for p in prompts})
    assert cont_engine.prefilled == unique + s["tool_tokens"] + s["turns"] - s["sequences"]
    assert resend_engine.prefilled > 2 * cont_engine.prefilled


def test_a_continued_call_frees_the_kept_kv_once_prefilled():
    # the kept K/V is copied into the new cache by the prefill; holding it through the decode
    # too would keep ~3x the context's K/V alive where a whole-context call needs 1x
    import gc
    import weakref

    engine = engine_from_hf(bigram_llama())
    session = engine.open_session()
    out = session.generate(PROMPTS, _params(3), [0, 1, 2])
    kept = [weakref.ref(row.kv[0][0]) for row in session.rows.values()]
    assert kept
    ctx = [PROMPTS[b] + out.response_ids[b][out.response_mask[b].bool()].tolist()
           + TOK.encode(" 7>") for b in range(3)]
    alive, forward = [], engine.forward

    def counted(ids, *args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in kept))
        return forward(ids, *args, **kwargs)

    engine.forward = counted
    session.generate(ctx, _params(3), [0, 1, 2])
    assert len(alive) >= 2 and alive[0] == len(kept)  # the prefill still reads them
    assert alive[1:] == [0] * (len(alive) - 1), alive  # freed for every decode step
