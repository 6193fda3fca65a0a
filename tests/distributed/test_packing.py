"""Packed micro-batches give the padded path's numbers, on gloo ranks (``model.pack_sequences``).

Two launches: world 4 runs (t,p,d) = (2,2,1), (1,2,2), (2,2,1) with sequence parallelism
(the pack padded at its tail, megatron's own attention path with THD) and (1,2,2) with one SDPA
call per sequence (instead of the block-diagonal mask) in ONE process group;
world 1 runs (1,1,1). Each case (tests/distributed/packing_cases.py) runs actor and critic
from the same seeded weights once with right-padded and once with packed micro-batches (one of
them a single sequence; one sequence of ONE token; empty responses) and compares on the rank:
response log-probs, entropy, values, the actor and critic losses, grad norms and every
DP-reduced gradient within 1e-5, the parameters after one Adam step within 1e-4 (Adam's first
step lr·g/(|g| + eps) magnifies rounding where a gradient is near 0). Here, in the parent, the
packed log-probs and values of every layout equal the (1,1,1) padded run's (1e-5).
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridrl.testing.dist import run_on_ranks
from tests.distributed import packing_cases

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # a tiny GQA llama, weights the same at every layout
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = str(tmp_path_factory.mktemp("packing") / "llama")
    model.save_pretrained(folder)
    w4 = [dict(tp=2, pp=2, folder=folder), dict(tp=1, pp=2, folder=folder),
          dict(tp=2, pp=2, sp=True, folder=folder), dict(tp=1, pp=2, loop=True, folder=folder)]
    pre = ("megatron.core",)
    return {4: run_on_ranks(packing_cases.run_cases, 4, w4, timeout=400, preload=pre),
            1: run_on_ranks(packing_cases.run_cases, 1, [dict(tp=1, pp=1, folder=folder)],
                            timeout=200, preload=pre)}


CASES = [(4, 0), (4, 1), (4, 2), (4, 3), (1, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("world,index", CASES)
def test_packed_equals_padded_on_every_rank(results, world, index):
    for rank_results in results[world]:
        r = rank_results[index]
        for key, diff in r["diffs"].items():
            tol = 10 * TOL if key.endswith("_params") else TOL
            assert diff <= tol, (key, diff, r["scale"][key])
        assert r["scale"]["actor_grad_norm"] > 0.1 and r["scale"]["critic_grad_norm"] > 0.1


def _assemble(rank_results, index, key):
    parts = sorted((r[index]["dp_rank"], r[index][key]) for r in rank_results if key in r[index])
    return np.concatenate([p for _, p in parts])


@pytest.mark.slow
@pytest.mark.parametrize("world,index", CASES)
def test_every_layout_equals_the_single_rank_padded_run(results, world, index):
    for key in ("logprobs", "values"):
        ref = _assemble(results[1], 0, f"padded_{key}")
        got = _assemble(results[world], index, key)
        assert got.shape == ref.shape == (packing_cases.N_SEQS, packing_cases.R)
        np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
        assert np.abs(ref).max() > 0.1  # real numbers, not zeros


def test_plan_puts_one_sequence_alone_and_a_one_token_sequence_in():
    """The cases cover what the issue asks: a pack of one sequence, a one-token sequence."""
    assert packing_cases.PROMPT_LENS[0] + packing_cases.RESP_LENS[0] == 1
    for dp in (1, 2):
        assert all(len(p) == 1 for p in [packing_cases._parts(dp, r)[0] for r in range(dp)])
