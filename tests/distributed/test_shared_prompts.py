"""Shared prompts through the whole trainer, on 2 gloo ranks (``model.share_prompts``).

One launch runs the tiny PPO run of ``test_trainer_cases`` (2 steps) with sharing on and off:
at dp 2 (rollout.n 4, KL loss and entropy bonus, token-budget micro-batches); at tp 2 with
sequence parallelism (PPO with a critic, rollout.n 3 in micro-batches of 3: each group's pack
has an odd length, padded to a multiple of tp at its tail, the pad continuing the last
response's positions; megatron's linears gather and scatter the sequence around the lean
attention); at pp 2 (both stages read the layout). Every logged number of the two runs agrees
(losses, grad norms, KL, log-prob gaps, values, rewards: 2e-5), the shared runs did share
(``perf/shared_prompt_frac`` > 0) and the unshared ones did not. Token budgets keep a group in
one pack only with sharing on, and per-micro-batch mean metrics (ppo_kl, clip fractions)
follow the packs' composition, so the dp 2 case's budget (320) fits whole groups either way."""

from __future__ import annotations

import math

import pytest

from hybridrl.testing.dist import run_on_ranks
from tests.distributed import test_trainer_cases as cases_mod

DP2 = ["actor.use_kl_loss=true", "actor.entropy_coeff=0.01", "rollout.temperature=1.0",
       "rollout.n=4", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=320",
       "ref.log_prob_micro_batch_size_per_gpu=4"]
SP = ["parallel.tp=2", "parallel.gen.tp=2", "model.sequence_parallel=true", "rollout.n=3",
      "actor.ppo_micro_batch_size_per_gpu=3", "critic.ppo_micro_batch_size_per_gpu=3",
      "ref.log_prob_micro_batch_size_per_gpu=3"]  # a group's pack: odd S, a tail pad of one
PP2 = ["parallel.pp=2"]  # micro-batches of 2 rows: one group each, 2 a pipeline
CASES = {"dp2_n4": DP2, "tp2_sp": SP, "pp2": PP2}
SKIP = ("timing_s/", "reshard/", "rollout/handoff", "perf/throughput", "perf/tokens_per_s",
        "perf/pad_fraction", "perf/shared_prompt_frac", "actor/lr", "critic/lr")


def _fit(rank, world, root, overrides):
    trainer, _ = cases_mod._trainer(rank, world, cases_mod.base_overrides(root) + overrides)
    return trainer.fit()


def _run(rank, world, root):
    out = {}
    for name, extra in CASES.items():
        for share in (True, False):
            out[(name, share)] = _fit(rank, world, root,
                                      [*extra, f"model.share_prompts={str(share).lower()}",
                                       *cases_mod.run_in(f"{root}/{name}_{share}")])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shared"))
    return run_on_ranks(_run, 2, root, timeout=400, preload=("megatron.core",))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sharing_on_equals_off(results, name):
    for ranked in results:
        on, off = ranked[(name, True)], ranked[(name, False)]
        assert len(on) == len(off) == 2
        for m_on, m_off in zip(on, off):
            keys = [k for k in m_off if not k.startswith(SKIP)]
            assert set(keys) <= set(m_on)
            for k in keys:
                assert math.isclose(m_on[k], m_off[k], rel_tol=2e-5, abs_tol=2e-5), (
                    k, m_on[k], m_off[k])
            assert m_on["perf/shared_prompt_frac"] > 0.1 and m_off[
                "perf/shared_prompt_frac"] == 0.0
            if name == "tp2_sp":  # the shared packs were padded at their tail (SP)
                assert m_on["perf/pad_fraction"] > 0
        assert all(m["actor/grad_norm"] > 1e-3 for m in off)  # a real update compared
