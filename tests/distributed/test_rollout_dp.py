"""Rollouts partitioned over DP (issue 12): 8 gloo ranks against 1, step for step.

One ``run_on_ranks`` call per world size runs every case (``test_rollout_dp_cases``); all runs
load one HF folder so every layout starts from the same weights. Checked in the parent:
- PPO (GAE with critic, KL loss, in-reward KL with the adaptive controller, token-budget actor
  micro-batches) on tp 2 x pp 2 x dp 2 (gen tp 2, greedy) equals the 1-rank run's metrics at
  both steps within fp32 tolerance, and so does dp 8;
- GRPO (sampled at temperature 1: per-request seeds make samples layout-invariant) on
  (2, 2, 2) equals the 1-rank run, with a counting reward function: each sequence is scored
  exactly once per step in the whole job (8 sequences x 2 steps lines, not x 8 ranks);
- each rank holds exactly its DP replica's rows (N/dp: the per-rank rollout tensors shrink as
  1/d) and receives at most that share's bytes (int32 ids + fp32 log-probs);
- a reward function that raises stops every rank with the same one line naming the function,
  the data_source and the row.
"""

from __future__ import annotations

import pytest

from hybridrl.testing.dist import run_on_ranks
from tests.distributed import test_rollout_dp_cases as cases_mod
from tests.distributed.test_trainer import _close, _save_hf
from tests.distributed.test_trainer_cases import run_in

GAE = ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "rollout.temperature=0",
       "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
       "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=200"]
GRPO = ["algorithm.adv_estimator=grpo", "actor.use_kl_loss=true", "rollout.temperature=1.0"]
DP8 = ["actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",  # 8 rows per mini-batch
       "actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1"]
D3 = ["parallel.tp=2", "parallel.pp=2", "parallel.gen.tp=2"]
N_SEQS, STEPS = 8, 2  # base config: 4 prompts x n = 2, 2 steps


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("rollout_dp")
    return str(path), _save_hf(path / "hf")


def _cases(root, world):
    r, hf = root
    folder = f"{r}/w{world}"
    import os

    os.makedirs(folder, exist_ok=True)
    spec = cases_mod.write_counting_reward(folder)
    common = [f"model.path={hf}", "model.tokenizer_path=char"]
    layout = D3 if world == 8 else []
    cases = [
        ("gae", [*common, *GAE, *layout, *run_in(f"{folder}/gae")], "fit"),
        ("gae_dp8", [*common, *GAE, *DP8, *run_in(f"{folder}/dp8")], "fit"),
        ("grpo", [*common, *GRPO, *layout, f"reward.reward_fn={spec}",
                  *run_in(f"{folder}/grpo")], "fit"),
    ]
    if world == 8:
        cases.append(("broken", [*common, *GRPO, *layout,
                                 f"reward.reward_fn={spec.replace(':count', ':broken')}",
                                 "trainer.total_steps=1", *run_in(f"{folder}/err")],
                      "error"))
    return cases


@pytest.fixture(scope="module")
def runs(root):
    return {world: run_on_ranks(cases_mod.run_cases, world, root[0], _cases(root, world),
                                timeout=900, preload=("megatron.core",))
            for world in (1, 8)}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gae", "gae_dp8", "grpo"])
def test_eight_ranks_equal_one_step_for_step(runs, case):
    want = runs[1][0][case]
    assert want["finite"] and len(want["metrics"]) == STEPS
    for rank, res in enumerate(runs[8]):
        assert res[case]["finite"], (case, rank)
        for step in range(STEPS):
            _close(res[case]["metrics"][step], want["metrics"][step])
    if case == "grpo":  # sampled, scored, non-trivial advantages
        assert any(m["actor/pg_loss"] != 0 for m in want["metrics"])


@pytest.mark.slow
def test_each_sequence_is_scored_once_in_the_job(runs, root):
    for world in (1, 8):
        lines = open(f"{root[0]}/w{world}/calls.log").read().splitlines()
        # the grpo run scores; the "broken" run raises before logging anything
        assert len(lines) == N_SEQS * STEPS, (world, len(lines))


@pytest.mark.slow
def test_each_rank_holds_its_share_only(runs):
    for case, dp in (("gae", 2), ("grpo", 2), ("gae_dp8", 8)):
        seen = {}
        for rank, res in enumerate(runs[8]):
            rows = res[case]["rows"]
            assert len(rows) == N_SEQS // dp and res[case]["n_rows"] == N_SEQS  # 1/d
            seen.setdefault(tuple(rows), 0)
            seen[tuple(rows)] += 1
            # at most the share's tokens (6 per row here) as int32 ids + fp32 log-probs
            assert res[case]["bytes_in"] <= len(rows) * 6 * 8, (case, rank)
            assert res[case]["scalar_bytes"] == 4 * N_SEQS
        assert sorted(r for rows in seen for r in rows) == list(range(N_SEQS))  # a partition
        assert set(seen.values()) == {8 // dp}  # every rank of a replica holds its rows
    grpo_rows = runs[8][0]["grpo"]["rows"]
    assert all(r ^ 1 in grpo_rows for r in grpo_rows)  # GRPO: both samples of a prompt together


@pytest.mark.slow
def test_a_failing_reward_stops_every_rank_with_one_line(runs):
    lines = {res["broken"] for res in runs[8]}
    assert len(lines) == 1
    line = lines.pop()
    assert line and "\n" not in line
    assert line.startswith("reward function '") and "broken" in line
    assert "raised ValueError: sandbox unreachable on row " in line
    assert "(data_source 'hybridrl/arithmetic', index " in line
