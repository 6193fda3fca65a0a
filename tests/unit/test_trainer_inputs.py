"""What a Python caller hands the trainer (issue 42 item 4), without ranks: the estimator as a
name or callable, the reward as a callable or a mapping, the trainer's own RNG scope; and the
GAE statement of docs/from_verl.md (the kernel is not whitened, the estimator is verl's)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import hybridrl
from hybridrl.algos.advantages import ADVANTAGE_ESTIMATORS
from hybridrl.rewards.scoring import REWARD_FNS
from hybridrl.trainer.inputs import reward_scorer, with_estimator
from hybridrl.trainer.rng import RngScope


def _cfg(*items):
    return hybridrl.load_config([], ["rollout.n=2", *items])


def _advantage(token_level_rewards, response_mask):
    return token_level_rewards, token_level_rewards


def test_estimator_by_name_or_callable():
    cfg = _cfg()
    assert with_estimator(cfg, None) is cfg
    assert with_estimator(cfg, "grpo").algorithm.adv_estimator == "grpo"
    assert not with_estimator(cfg, "grpo").use_critic and cfg.use_critic
    with pytest.raises(ValueError, match=r"^adv_estimator 'nope' is not a registered advantage "
                                         r"estimator; registered: \["):
        with_estimator(cfg, "nope")
    name = with_estimator(cfg, _advantage).algorithm.adv_estimator
    assert name == f"python:{__name__}._advantage"
    assert ADVANTAGE_ESTIMATORS.get(name) is _advantage
    registered = ADVANTAGE_ESTIMATORS.get("rloo")  # a registered function keeps its own name
    assert with_estimator(cfg, registered).algorithm.adv_estimator == "rloo"
    with pytest.raises(ValueError, match="a registered name or a callable; got int"):
        with_estimator(cfg, 3)


def _mine(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5


def test_reward_callable_scores_every_row_and_a_mapping_adds_sources():
    scorer = reward_scorer(_cfg(), _mine)
    assert scorer.score_one("any/source", "x", "1", {}) == (0.5, {})
    scorer = reward_scorer(_cfg(), {"mine/src": _mine})
    assert scorer.score_one("mine/src", "x", "1", {})[0] == 0.5
    assert scorer.registry.get("openai/gsm8k") is REWARD_FNS.get("openai/gsm8k")  # builtins kept
    assert "mine/src" not in REWARD_FNS  # the shared registry is untouched


@pytest.mark.parametrize("items, fn, line", [
    (["reward.reward_fn=m:f"], _mine, "reward_fn is given and reward.reward_fn is set"),
    (["reward.num_workers=2"], _mine, "reward_fn callables score in the rank's own process; "
                                      "reward.num_workers=2 must be 0"),
    ([], lambda a: 0.0, "reward function '<lambda>'"),  # cannot take verl's four arguments
    ([], 3, "reward_fn must be a callable or a mapping data_source -> callable; got int"),
])
def test_reward_misuse_is_one_line(items, fn, line):
    with pytest.raises(ValueError) as info:
        reward_scorer(_cfg(*items), fn)
    assert str(info.value).startswith(line) and "\n" not in str(info.value), str(info.value)


def _states():
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and bool((a[1] == b[1]).all()) and a[2] == b[2]


def test_rng_scope_keeps_the_callers_states_and_its_own():
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    outer = _states()
    scope = RngScope()
    with scope:
        torch.manual_seed(123)  # what a model build does
        np.random.seed(123)
        random.seed(123)
        with scope:  # nested: no second swap
            first = torch.rand(3)
    assert _same(outer, _states())
    with scope:  # continues from where the scope stopped, not from the caller's state
        second = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))
    torch.set_rng_state(outer[0])  # the check above reseeded the caller's generator
    with pytest.raises(RuntimeError), scope:
        torch.rand(1)
        raise RuntimeError("inside")
    assert _same(outer, _states())


def test_gae_kernel_is_unwhitened_and_the_estimator_is_verls():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    adv_k, ret_k = hybridrl.gae(rewards, values, mask, 0.9, 0.8)
    adv_e, ret_e = hybridrl.compute_advantage("gae", rewards, mask, values=values, gamma=0.9,
                                              lam=0.8)
    torch.testing.assert_close(adv_e, hybridrl.masked_whiten(adv_k, mask))
    torch.testing.assert_close(ret_e, ret_k)
    torch.testing.assert_close(ret_k, adv_k + values)  # returns from the unwhitened advantages
    assert abs(float(adv_k[mask.bool()].mean())) > 1e-3  # the kernel's are not centred


def test_startup_check_of_parquet_sources_knows_the_python_reward(tmp_path):
    from hybridrl.data.arithmetic import make_rows
    from hybridrl.data.schema import write_rows
    from hybridrl.trainer.startup import check_startup

    rows = make_rows(4, seed=0, max_digits=1)
    for row in rows:
        row.data_source = "mine/src"
    path = write_rows(str(tmp_path / "t.parquet"), rows)
    cfg = _cfg(f"data.train_files=[{path}]", f"trainer.output_dir={tmp_path}/out")
    unknown = [p for p in check_startup(cfg, 0) if "has no reward function" in p]
    assert len(unknown) == 1 and "data_source 'mine/src' (rows [0, 1, 2])" in unknown[0]
    assert not [p for p in check_startup(cfg, 0, reward_fn=_mine) if "reward" in p]
    assert not [p for p in check_startup(cfg, 0, reward_fn={"mine/src": _mine}) if "reward" in p]
    assert [p for p in check_startup(cfg, 0, reward_fn={"other": _mine}) if "reward" in p]
