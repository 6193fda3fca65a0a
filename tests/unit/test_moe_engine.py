"""Builtin engine with Qwen3-MoE layers (issue 38 item 4) against transformers'
Qwen3MoeForCausalLM: greedy tokens and log-probs, the returned top-k expert ids per token and
layer, in one part and in two parts per expert (the training-TP blocks), with and without
``norm_topk_prob``.

The engine's tensors come from this file's own HF -> engine packing (``moe_engine_shards``),
not from the library's reshard.
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.reshard.specs import LlamaShape
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec
from tests.unit.test_reshard_oracle import engine_shards

VOCAB, CHUNK, E, K, FM = 100, 128, 8, 2, 16


def tiny_moe(seed: int = 0, norm: bool = True):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=FM, num_experts=E,
        num_experts_per_tok=K, norm_topk_prob=norm, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
        rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[],
        attn_implementation="eager")
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def moe_engine_shards(model, n: int, b: int) -> dict[str, torch.Tensor]:
    """Engine-format tensors of gen TP rank b of n: attention and norms by the dense oracle,
    the router whole, each expert's [gate; up] rows and down columns of the rank's F slice."""
    c = model.config
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shape = LlamaShape(hidden=c.hidden_size, ffn=FM, heads=c.num_attention_heads,
                       num_query_groups=c.num_key_value_heads, layers=c.num_hidden_layers,
                       vocab=c.vocab_size, head_dim=c.head_dim)
    f = FM // n
    moe = {}
    for L in range(c.num_hidden_layers):
        h = f"model.layers.{L}.mlp."
        gate_up, down = hf.pop(h + "experts.gate_up_proj"), hf.pop(h + "experts.down_proj")
        for name in ("gate_proj", "up_proj", "down_proj"):  # the dense oracle's placeholders
            hf[f"{h}{name}.weight"] = torch.zeros(1, 1)
        moe[h + "gate.weight"] = hf.pop(h + "gate.weight")
        for e in range(E):
            g, u = gate_up[e].chunk(2)  # HF keeps [E, 2F, H] = [gate; up] per expert in memory
            moe[f"{h}experts.{e}.gate_up_proj.weight"] = torch.cat(
                [g[b * f:(b + 1) * f], u[b * f:(b + 1) * f]])
            moe[f"{h}experts.{e}.down_proj.weight"] = down[e][:, b * f:(b + 1) * f]
    for L in range(c.num_hidden_layers):
        for name in ("q_norm", "k_norm"):
            moe[f"model.layers.{L}.self_attn.{name}.weight"] = hf[
                f"model.layers.{L}.self_attn.{name}.weight"]
    dense = engine_shards(shape, hf, n, b, 1, 0, CHUNK // n)
    dense = {k: v for k, v in dense.items() if ".mlp." not in k}
    return {**dense, **moe}


def engine_of(model, blocks: int = 1) -> BuiltinEngine:
    c = model.config
    spec = EngineSpec(c.hidden_size, c.intermediate_size, c.num_attention_heads,
                      c.num_key_value_heads, c.head_dim, c.num_hidden_layers, VOCAB, CHUNK,
                      c.rope_parameters["rope_theta"], c.rms_norm_eps, False,
                      c.max_position_embeddings, qk_norm=True, num_experts=E, moe_topk=K,
                      moe_ffn_hidden_size=FM, moe_norm_topk_prob=c.norm_topk_prob)
    engine = BuiltinEngine(spec, blocks=blocks)
    engine.update_weights(moe_engine_shards(model, 1, 0).items())
    return engine


def hf_greedy_routed(model, prompt: list[int], n: int):
    """Greedy tokens, their log-probs (full re-forward, no cache), and transformers' top-k
    expert ids [tokens, layers, k] of the whole final sequence but its last token."""
    ids, logps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            t = int(logits.argmax())
            logps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
        out = model(torch.tensor([ids[:-1]]), output_router_logits=True)
    top = [torch.topk(torch.softmax(r.float(), -1), K, dim=-1).indices for r in out.router_logits]
    return ids[len(prompt):], logps, torch.stack(top, dim=1)  # [T, layers, k]


PROMPTS = [[5, 17, 42, 8, 9, 33], [7, 1], [99, 0, 3, 61]]


@pytest.mark.parametrize("norm, blocks", [(True, 1), (True, 2), (False, 1)])
def test_moe_greedy_and_routing_match_transformers(norm, blocks):
    model = tiny_moe(norm=norm)
    engine = engine_of(model, blocks)
    n = 6
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=n, temperature=0.0))
    assert out.routed_experts is not None and out.routed_experts.dtype == torch.int16
    assert out.routed_experts.shape == (3, 6 + n, 2, K)
    for b, prompt in enumerate(PROMPTS):
        toks, logps, top = hf_greedy_routed(model, prompt, n)
        assert out.response_ids[b].tolist() == toks
        torch.testing.assert_close(out.logprobs[b], torch.tensor(logps), atol=1e-5, rtol=0)
        T = len(prompt) + n - 1  # every token but the last went through the engine
        got = out.routed_experts[b]
        assert torch.equal(got[:T].long().sort(-1).values, top.sort(-1).values), b
        assert (got[T:] == -1).all()  # the last token and the padding


def test_moe_parts_route_alike_and_dense_engines_return_no_ids():
    model = tiny_moe(seed=3)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=11)
    one, two = (engine_of(model, k).generate(PROMPTS, params) for k in (1, 2))
    assert torch.equal(one.response_ids, two.response_ids)
    assert torch.equal(one.routed_experts, two.routed_experts)
    from tests.unit.test_rollout import engine_from_hf, tiny_hf
    dense = engine_from_hf(tiny_hf()).generate(PROMPTS, params)
    assert dense.routed_experts is None


def test_moe_spec_and_weight_checks():
    base = dict(hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_kv_heads=2,
                head_dim=8, num_layers=1, vocab_size=VOCAB, vocab_chunk=CHUNK)
    with pytest.raises(ValueError, match="moe_topk"):
        EngineSpec(**base, num_experts=4, moe_topk=5, moe_ffn_hidden_size=8)
    with pytest.raises(ValueError, match="moe_ffn_hidden_size"):
        EngineSpec(**base, num_experts=4, moe_topk=2)
    spec = EngineSpec(**base, num_experts=4, moe_topk=2, moe_ffn_hidden_size=3)
    with pytest.raises(ValueError, match="moe_ffn_hidden_size=3"):
        BuiltinEngine(spec, blocks=2)
    engine = BuiltinEngine(spec)
    assert engine.block_shape("model.layers.0.mlp.experts.3.down_proj.weight") == (32, 3)
    with pytest.raises(ValueError, match="unknown weight"):
        engine.update_weights([("model.layers.0.mlp.gate_up_proj.weight", torch.zeros(12, 32))])
    assert "model.layers.0.mlp.gate.weight" in engine.missing_weights()


def test_routed_ids_of_a_row_do_not_depend_on_its_batch():
    """Rows that stop early (eos) leave the batch (compaction); each row's ids and tokens equal
    those of the row generated alone (per-row seeds)."""
    model = tiny_moe(seed=5)
    engine = engine_of(model)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, row_seeds=(1, 2, 3),
                            eos_token_id=None)
    probe = engine.generate(PROMPTS, params)
    eos = int(probe.response_ids[0, 1])  # a token some row samples early
    params = SamplingParams(max_new_tokens=8, temperature=1.0, row_seeds=(1, 2, 3),
                            eos_token_id=eos)
    batch = engine.generate(PROMPTS, params)
    assert int(batch.response_mask.sum(-1).min()) < 8  # some row stopped early
    for b, prompt in enumerate(PROMPTS):
        one = engine.generate([prompt], SamplingParams(
            max_new_tokens=8, temperature=1.0, row_seeds=(b + 1,), eos_token_id=eos))
        n = int(one.response_mask.sum())
        assert batch.response_ids[b, :n].tolist() == one.response_ids[0, :n].tolist()
        T = len(prompt) + n - 1
        assert torch.equal(batch.routed_experts[b, :T], one.routed_experts[0, :T]), b
        assert (batch.routed_experts[b, T:] == -1).all()
