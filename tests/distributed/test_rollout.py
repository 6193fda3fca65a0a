"""The builtin engine on 2 gen-TP ranks (gloo) against transformers' LlamaForCausalLM.

Each rank loads its engine-format shard (cut from the HF tensors by the independent oracle
``engine_shards``: half the heads, half the FFN, half the padded vocabulary), so every forward
runs the TP all-reduces and the vocab all-gather. Checked in the parent against one process of
transformers: last-position logits of every prompt (1e-5), greedy tokens and their log-probs,
sampled tokens' log-probs at temperature 0.8 (top-k/top-p on) against the HF recompute, and that
both TP ranks return the same responses. The engine-vs-megatron-actor log-prob check on 2 ranks
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
