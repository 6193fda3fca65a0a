"""The planner's logits term against the vocab-parallel log-prob/entropy's real peak on 2 gloo ranks.

Every tensor the log-prob/entropy (hybridrl.models.vocab_parallel) creates, the logits slice
[1, T, V/tp] and its gradient included, is tracked from its allocation to its release (the dispatch
mode of test_memory_plan.py); the live bytes' peak of a training pass (forward and backward,
loss on log-probs and entropy) and of a forward without grad must be within 10 % of
``hybridrl.planning.memory.logits_bytes`` at tp = 2, for bf16 and fp32 logits.
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks

T, VOCAB = 256, 4096  # VOCAB a multiple of 128 x tp: no padding rows


def _peak(dtype, train: bool) -> int:
    import torch.distributed as dist

    from hybridrl.models.vocab_parallel import vocab_parallel_logprobs_entropy
    from tests.distributed.test_memory_plan import live_bytes_mode

    tp, rank = dist.get_world_size(), dist.get_rank()
    v_local = VOCAB // tp
    gen = torch.Generator().manual_seed(rank)
    labels = torch.randint(0, VOCAB, (1, T), generator=gen)
    mode = live_bytes_mode(set())
    with mode, torch.set_grad_enabled(train):
        logits = torch.randn(1, T, v_local, generator=gen, dtype=dtype).requires_grad_(train)
        logp, ent = vocab_parallel_logprobs_entropy(logits, labels, dist.group.WORLD,
                                                    vocab_start=rank * v_local, vocab_size=VOCAB)
        if train:
            loss = -logp.mean() - 0.01 * ent.mean()
            del logp, ent
            loss.backward()
            del loss
    return mode.peak


def _rank(rank, world):
    return {f"{dt}_{train}": _peak(getattr(torch, dt), train)
            for dt in ("bfloat16", "float32") for train in (True, False)}


@pytest.fixture(scope="module")
def peaks():
    return run_on_ranks(_rank, 2, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,plan_dtype", [("bfloat16", "bf16"), ("float32", "fp32")])
@pytest.mark.parametrize("train", [True, False])
def test_logits_term_within_10_percent_of_the_measured_peak(peaks, dtype, plan_dtype, train):
    from hybridrl.planning.memory import MemoryJob, logits_bytes
    from hybridrl.reshard.specs import LlamaShape

    shape = LlamaShape(hidden=64, ffn=128, heads=4, num_query_groups=2, layers=2, vocab=VOCAB)
    job = MemoryJob(shape=shape, world=2, tp=2, dtype=plan_dtype, max_tokens_per_gpu=T,
                    seq_len=T)
    plan = logits_bytes(job, T, forward_only=not train)
    for rank_peaks in peaks:
        measured = rank_peaks[f"{dtype}_{train}"]
        print(f"{dtype} train={train}: plan {plan} measured {measured} "
              f"({plan / measured - 1:+.1%})")
        assert abs(plan - measured) <= 0.1 * measured, (plan, measured)
