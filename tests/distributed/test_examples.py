"""The runnable Python examples, on 2 gloo ranks in ONE process group (one start-up for all):

- custom_engine_from_megatron.py: a tp=2 megatron-core GPTModel resharded into the 20-line
  HFEngine gives every rank exactly the HF checkpoint's tensors (so the engine's greedy output
  equals transformers' on the original folder), receiving less than the whole model;
- custom_reward_and_estimator.py: the registered reward function scores every step (its
  data_source metric is there; its 0 / 0.2 / 1 values bound the mean) and the registered
  estimator computes every step's advantages on the whole batch, at dp = 2.
The plain-torch example runs in tests/unit/test_examples_torch_loop.py (no ranks needed).
"""

from __future__ import annotations

import os

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks
from tests.support.examples import load_example

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank, world, hf_folder, workdir):
    os.chdir(ROOT)
    engine = load_example("custom_engine_from_megatron").run(rank, world, hf_folder)
    history, calls = load_example("custom_reward_and_estimator").main(workdir, steps=2)
    return {"engine": engine, "history": history, "calls": calls}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("examples")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=96,
        tie_word_embeddings=False, rms_norm_eps=1e-5))
    model.save_pretrained(folder / "hf")
    out = run_on_ranks(_rank, 2, str(folder / "hf"), str(folder / "work"), timeout=400)
    return model.eval(), out


@pytest.mark.slow
def test_engine_receives_the_exact_checkpoint(results):
    model, out = results
    want = model.state_dict()
    for rank_out in out:
        got = rank_out["engine"]["state"]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        with torch.no_grad():
            ref = model.generate(torch.tensor([[1, 5, 9, 2]]), max_new_tokens=5, do_sample=False,
                                 pad_token_id=0)[:, 4:]
        assert torch.equal(rank_out["engine"]["out"].response_ids, ref)
    full = sum(t.numel() * t.element_size() for t in want.values())
    for rank_out in out:  # a rank receives only what its TP half lacks, never the whole model
        assert 0 < rank_out["engine"]["bytes_received"] < full


@pytest.mark.slow
def test_registered_reward_and_estimator_drive_the_trainer(results):
    _, out = results
    for rank_out in out:
        history, calls = rank_out["history"], rank_out["calls"]
        assert len(history) == 2 and len(calls) == 2
        assert all(shape[0] == 8 for shape in calls)  # 4 prompts x n=2, the whole batch
        for m in history:
            assert "reward/source/example/partial_credit/mean" in m
            assert 0.0 <= m["critic/score/mean"] <= 1.0 and m["critic/score/max"] in (0.0, 0.2, 1.0)
