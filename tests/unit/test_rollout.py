"""Builtin engine on one process (gen tp = 1) against transformers' LlamaForCausalLM and
Qwen2ForCausalLM (q/k/v biases), sampling filters, parameter validation and the SGLang adapter's
missing-import error.

The engine's tensors come from the independent oracle ``engine_shards`` (HF -> SGLang packing),
so the engine is checked against HF without going through the library's reshard.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridrl.reshard.specs import LlamaShape
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.builtin.engine import BuiltinEngine, EngineSpec
from hybridrl.rollout.sampling import filter_logits, sample_next
from tests.unit.test_reshard_oracle import engine_shards

VOCAB, CHUNK = 100, 128  # SGLang pads the vocab to a multiple of 64: 128 rows per rank at tp=1


def tiny_hf(tied: bool = False, seed: int = 0, qwen2: bool = False):
    import transformers

    torch.manual_seed(seed)
    config_cls, model_cls = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if qwen2
                             else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    cfg = config_cls(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                     max_position_embeddings=64, tie_word_embeddings=tied, rms_norm_eps=1e-5,
                     attn_implementation="eager")
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def engine_from_hf(model, tp: int = 1, tp_rank: int = 0, **kwargs) -> BuiltinEngine:
    c = model.config
    bias = c.model_type == "qwen2"
    shape = LlamaShape(hidden=c.hidden_size, ffn=c.intermediate_size, heads=c.num_attention_heads,
                       num_query_groups=c.num_key_value_heads, layers=c.num_hidden_layers,
                       vocab=c.vocab_size, tied=c.tie_word_embeddings, qkv_bias=bias)
    chunk = -(-(-(-c.vocab_size // 64) * 64) // tp)
    theta = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
    spec = EngineSpec(c.hidden_size, c.intermediate_size, c.num_attention_heads,
                      c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                      c.num_hidden_layers, c.vocab_size, chunk, theta, c.rms_norm_eps,
                      c.tie_word_embeddings, c.max_position_embeddings, qkv_bias=bias)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = BuiltinEngine(spec, tp_rank=tp_rank, tp_size=tp, **kwargs)
    engine.update_weights(engine_shards(shape, hf, tp, tp_rank, 1, 0, chunk).items())
    return engine


def hf_greedy(model, prompt: list[int], n: int):
    """Greedy tokens and their log-probs by full re-forward (no cache)."""
    ids, toks, logps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            t = int(logits.argmax())
            toks.append(t)
            logps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
    return toks, logps


PROMPTS = [[5, 17, 42, 8, 9, 33], [7, 1], [99, 0, 3, 61]]


@pytest.mark.parametrize("tied, qwen2", [(False, False), (True, False), (False, True)])
def test_greedy_matches_transformers(tied, qwen2):
    model = tiny_hf(tied, qwen2=qwen2)
    if qwen2:  # biases well away from 0, so that dropping or misplacing one shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.copy_(torch.randn_like(p))
    engine = engine_from_hf(model)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    for b, prompt in enumerate(PROMPTS):
        toks, logps = hf_greedy(model, prompt, 6)
        assert out.response_ids[b].tolist() == toks
        torch.testing.assert_close(out.logprobs[b], torch.tensor(logps), atol=1e-5, rtol=0)
        assert out.response_mask[b].tolist() == [1] * 6


@pytest.mark.parametrize("tied, qwen2, blocks", [(False, False, 2), (True, False, 2),
                                                 (False, True, 2), (False, False, 4)])
def test_engine_in_parts_matches_one_part(tied, qwen2, blocks):
    """blocks=K keeps each sharded tensor as K training-TP sub-shards (K matmuls): the same
    logits and greedy tokens as the engine holding whole tensors, the same whole tensors back,
    and each part is the sub-shard megatron would store at TP size K (checked on qkv, whose
    parts are consecutive KV groups, and gate_up, whose parts are [gate_k; up_k])."""
    model = tiny_hf(tied, qwen2=qwen2, seed=1)
    if blocks == 4:  # 4 parts need 4 KV heads
        import transformers

        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4,
                                       vocab_size=VOCAB, max_position_embeddings=64)
        torch.manual_seed(2)
        model = transformers.LlamaForCausalLM(cfg).eval()
    whole, parts = engine_from_hf(model), engine_from_hf(model, blocks=blocks)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    a, b = whole.generate(PROMPTS, params), parts.generate(PROMPTS, params)
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    for name, w in whole.weights.items():
        assert torch.equal(parts.weights[name], w), name
    H = 32
    qkv, gu = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"
    per = whole.weights[qkv].shape[0] // blocks
    assert [p.shape for p in parts.store.parts[qkv]] == [(per, H)] * blocks
    assert torch.equal(parts.store.parts[qkv][-1], whole.weights[qkv][-per:])
    f = 48 // blocks
    gate, up = whole.weights[gu][:48], whole.weights[gu][48:]
    assert torch.equal(parts.store.parts[gu][1], torch.cat([gate[f:2 * f], up[f:2 * f]]))


def test_stacked_gqa_attention_equals_sdpa_gqa():
    """The attention form used off the CPU (a KV head's query heads stacked against its keys,
    mask rows repeated) gives what the CPU form (SDPA's enable_gqa) gives, prefill and decode,
    left-padded prompts included."""
    model = tiny_hf(seed=3)
    native, stacked = engine_from_hf(model), engine_from_hf(model)
    stacked.native_gqa = False
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=5)
    a, b = native.generate(PROMPTS, params), stacked.generate(PROMPTS, params)
    assert native.native_gqa and torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_engine_parts_alias_and_checks():
    spec = EngineSpec(32, 48, 4, 2, 8, 2, VOCAB, CHUNK)
    engine = BuiltinEngine(spec, blocks=2)
    name = "model.layers.0.mlp.down_proj.weight"
    assert engine.block_shape(name) == (32, 24)
    with pytest.raises(ValueError, match="name the block"):
        engine.buffer(name, (32, 24))
    with pytest.raises(ValueError, match="expected"):
        engine.buffer(name, (32, 48), block=0)
    mine = torch.randn(32, 24)
    engine.alias(name, mine, block=1)
    assert engine.aliased == {name + "#1"}
    assert engine.store.parts[name][1].data_ptr() == mine.data_ptr()
    engine.buffer(name, (32, 24), block=1)  # its own storage again
    assert engine.aliased == set() and engine.store.parts[name][1].data_ptr() != mine.data_ptr()
    assert engine.block_shape("model.norm.weight") == (32,)
    with pytest.raises(ValueError, match="does not divide"):
        BuiltinEngine(spec, blocks=3)


def test_sampled_logprobs_match_transformers_at_temperature():
    model = tiny_hf()
    engine = engine_from_hf(model)
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=20, top_p=0.9, seed=3)
    out = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)
    assert torch.equal(out.response_ids, again.response_ids)  # seeded
    for b, prompt in enumerate(PROMPTS):
        seq = torch.tensor([prompt + out.response_ids[b].tolist()])
        with torch.no_grad():
            logits = model(seq).logits[0].float() / 0.7
        logp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
        want = logp.gather(-1, out.response_ids[b].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(out.logprobs[b], want, atol=1e-5, rtol=0)


def test_eos_stops_rows_and_pads():
    model = tiny_hf()
    engine = engine_from_hf(model)
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    eos = int(greedy.response_ids[0, 2])  # row 0 stops after its third token
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                  eos_token_id=eos, pad_token_id=0))
    row = out.response_ids[0].tolist()
    first = greedy.response_ids[0].tolist().index(eos)
    assert row[: first + 1] == greedy.response_ids[0].tolist()[: first + 1]
    assert out.response_mask[0].tolist()[: first + 1] == [1] * (first + 1)
    assert all(m == 0 for m in out.response_mask[0].tolist()[first + 1:])
    assert all(t == 0 for t in row[first + 1:])


def test_stop_token_ids_end_rows_like_eos():
    """A multi-turn rollout's tool-call marker ends a row as eos does (the marker is kept)."""
    model = tiny_hf()
    engine = engine_from_hf(model)
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    marks = (int(greedy.response_ids[0, 1]), int(greedy.response_ids[1, 3]))
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                  stop_token_ids=marks))
    for b in range(2):
        full = greedy.response_ids[b].tolist()
        end = min(full.index(m) for m in marks if m in full) + 1
        assert out.response_mask[b].tolist() == [1] * end + [0] * (6 - end), (b, marks)
        assert out.response_ids[b].tolist()[:end] == full[:end]
    with pytest.raises(ValueError, match="stop_token_ids must be a tuple"):
        SamplingParams(max_new_tokens=1, stop_token_ids=[3])


def test_filters_and_sampling():
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(z, top_k=2)).tolist() == [[False, False, True, True]]
    p = torch.softmax(z, -1)[0]  # 0.644, 0.237, 0.087, 0.032
    kept = ~torch.isinf(filter_logits(z, top_p=float(p[0] + 0.01)))
    assert kept.tolist() == [[True, True, False, False]]
    assert (~torch.isinf(filter_logits(z, top_p=0.1))).tolist() == [[True, False, False, False]]
    g = torch.Generator().manual_seed(0)
    toks, logp = sample_next(z.repeat(64, 1), SamplingParams(1, temperature=1.0, top_k=1), g)
    assert toks.eq(0).all()
    torch.testing.assert_close(logp, torch.log_softmax(z, -1)[0, 0].expand(64))


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=1, top_p=0.0)
    spec = EngineSpec(32, 48, 4, 2, 8, 2, VOCAB, CHUNK)
    with pytest.raises(ValueError, match="gen pp = 1"):
        BuiltinEngine(spec, pp_size=2)
    engine = BuiltinEngine(spec)
    with pytest.raises(ValueError, match="not loaded"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="unknown weight"):
        engine.update_weights([("model.nope", torch.zeros(3))])


def test_sglang_missing_is_a_clear_import_error(monkeypatch):
    """Not installed, or installed but not importable here: one line naming the way out, whether
    or not this machine has SGLang (both cases are made, not found)."""
    import sys
    from importlib import metadata

    from hybridrl.rollout.sglang.adapter import sglang_backend

    real_version = metadata.version

    def not_installed(name):
        if name == "sglang":
            raise metadata.PackageNotFoundError(name)
        return real_version(name)

    with monkeypatch.context() as m:
        m.setattr(metadata, "version", not_installed)
        with pytest.raises(ImportError, match="not installed here.*rollout.engine=builtin"):
            sglang_backend()
    with monkeypatch.context() as m:  # installed (the pinned release), but its import fails
        m.setattr(metadata, "version", lambda name: "0.5.21" if name == "sglang"
                  else real_version(name))
        m.setitem(sys.modules, "sglang", None)
        with pytest.raises(ImportError, match="cannot be imported here.*rollout.engine=builtin"):
            sglang_backend()


def _worker_on_one_rank(engine: str, qkv_bias: bool):
    """A RolloutWorker on a 1-rank layout (gen tp = 1: no process group is created)."""
    from types import SimpleNamespace

    from hybridrl.config.loader import load_config
    from hybridrl.models.spec import LlamaSpec
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.rollout.worker import RolloutWorker

    cfg = load_config(overrides=[f"rollout.engine={engine}", "model.path=/no/such/folder"])
    arch = "Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"
    spec = LlamaSpec(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=48, vocab_size=VOCAB, qkv_bias=qkv_bias, architecture=arch)
    actor = SimpleNamespace(spec=spec, config=SimpleNamespace(params_dtype=torch.float32),
                            uses_te=False, device="cpu")
    groups = SimpleNamespace(rank=0, train=TrainLayout(1), gen=None, groups={}, members={})
    return RolloutWorker(cfg, groups, actor, SimpleNamespace(pad_token_id=0, eos_token_id=2))


def test_worker_moves_qkv_biases_into_either_engine():
    worker = _worker_on_one_rank("builtin", qkv_bias=False)
    assert not worker.shape.qkv_bias
    assert not any("bias" in s.name for s in worker.plan.specs)
    # Qwen2: the worker plans the biases and the builtin engine expects them ...
    worker = _worker_on_one_rank("builtin", qkv_bias=True)
    assert any(s.name.endswith("linear_qkv.bias") for s in worker.plan.specs)
    assert worker.engine.spec.qkv_bias
    assert "model.layers.0.self_attn.qkv_proj.bias" in worker.engine.missing_weights()
    # ... and sglang gets past the worker's checks too (this machine then lacks SGLang)
    with pytest.raises(ImportError, match="rollout.engine=sglang needs SGLang"):
        _worker_on_one_rank("sglang", qkv_bias=True)


def test_rope_frequencies_live_on_the_engine_device_and_logprobs_are_unchanged():
    """inv_freq is on the engine's device from construction (no host-to-device copy per
    forward; the meta device makes that visible on a CPU-only machine), and the log-probs equal,
    bit for bit, those of the former per-forward copy."""
    from hybridrl.config.hf_model import RopeScaling

    yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=16)
    for scaling in (None, yarn):
        spec = EngineSpec(32, 48, 4, 2, 8, 2, VOCAB, CHUNK, rope_scaling=scaling,
                          max_position_embeddings=64)
        freq = BuiltinEngine(spec, device="meta").inv_freq
        assert freq.device.type == "meta" and freq.dtype == torch.float64
    engine = engine_from_hf(tiny_hf(seed=3))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    new = engine.generate(PROMPTS, params)
    host_freq = engine.inv_freq.cpu()

    def per_forward_copy(pos_BS, dtype):  # the former _rope_tables
        freqs_BSd = pos_BS.double().unsqueeze(-1) * host_freq.to(pos_BS.device)
        emb_BSD = torch.cat((freqs_BSd, freqs_BSd), dim=-1).unsqueeze(1)
        return emb_BSD.cos().to(dtype), emb_BSD.sin().to(dtype)

    engine._rope_tables = per_forward_copy
    old = engine.generate(PROMPTS, params)
    assert torch.equal(new.response_ids, old.response_ids)
    assert torch.equal(new.logprobs, old.logprobs)


def test_finished_rows_leave_the_batch_and_nothing_else_changes():
    """compact_at: rows that stopped are dropped from the decode batch (the KV cache, positions
    and per-row generators with them); every row's tokens, mask and log-probs equal a run that
    keeps decoding them, and the later decode steps really ran on fewer rows."""
    model = tiny_hf(seed=1)
    prompts = [[5 + i, 9, 3 + 2 * i, 7][: 2 + i % 3] for i in range(12)]
    params = SamplingParams(max_new_tokens=12, temperature=1.5, seed=4,
                            row_seeds=tuple(range(100, 112)), pad_token_id=0)
    free = engine_from_hf(model, compact_at=0.0).generate(prompts, params)
    counts = torch.bincount(free.response_ids[free.response_mask.bool()], minlength=VOCAB)
    eos = int(counts[1:].argmax()) + 1  # the most sampled token: rows stop at different steps
    params = dataclasses.replace(params, eos_token_id=eos)
    runs, sizes = {}, {}
    for at in (0.0, 0.25, 0.01):
        engine = engine_from_hf(model, compact_at=at)
        seen, forward = [], engine.forward
        engine.forward = lambda ids, *a, _f=forward, _s=seen: _s.append(ids.shape[0]) or _f(ids, *a)
        runs[at], sizes[at] = engine.generate(prompts, params), seen
    stops = (runs[0.0].response_mask.sum(1)).tolist()
    assert len(set(stops)) > 2, stops  # the case needs rows stopping at several steps
    assert set(sizes[0.0]) == {12}  # compact_at 0: every step decodes all 12 rows
    assert min(sizes[0.25]) < 12 and min(sizes[0.01]) < 12
    for at in (0.25, 0.01):
        assert torch.equal(runs[at].response_ids, runs[0.0].response_ids)
        assert torch.equal(runs[at].response_mask, runs[0.0].response_mask)
        torch.testing.assert_close(runs[at].logprobs, runs[0.0].logprobs, atol=1e-5, rtol=0)
