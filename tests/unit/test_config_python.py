"""load_config as a Python caller meets it (issue 42 item 4): verl's critic rule for hybridrl's
own keys, non-finite learning rates refused, and errors raised as one line from load_config
(no OmegaConf or dataclass-constructor frames under it)."""

from __future__ import annotations

import traceback

import pytest

from hybridrl.config import load_config


def test_critic_mini_batch_epochs_and_aggregation_follow_the_actor_unless_set(tmp_path):
    cfg = load_config([], ["actor.ppo_mini_batch_size=8", "actor.ppo_epochs=2",
                           "actor.loss_agg_mode=seq-mean-token-mean"])
    assert (cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_epochs,
            cfg.critic.loss_agg_mode) == (8, 2, "seq-mean-token-mean")
    # set explicitly (by an override, or by a file: even to the default value) it stays
    cfg = load_config([], ["actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=4"])
    assert (cfg.actor.ppo_mini_batch_size, cfg.critic.ppo_mini_batch_size) == (8, 4)
    yaml = tmp_path / "c.yaml"
    yaml.write_text("actor:\n  ppo_mini_batch_size: 8\ncritic:\n  ppo_mini_batch_size: 16\n")
    assert load_config([str(yaml)]).critic.ppo_mini_batch_size == 16
    yaml.write_text("actor:\n  ppo_mini_batch_size: 32\n")
    assert load_config([str(yaml)]).critic.ppo_mini_batch_size == 32
    # a later actor override still carries the critic along; the verl key too
    assert load_config([str(yaml)], ["actor.ppo_mini_batch_size=4"]).critic.ppo_mini_batch_size == 4
    assert load_config([], ["actor_rollout_ref.actor.ppo_mini_batch_size=8"]
                       ).critic.ppo_mini_batch_size == 8


def test_critic_that_follows_is_checked_like_one_that_is_set():
    # train_batch_size 4 with the actor's 2: the critic's former fixed default 16 refused the run
    cfg = load_config([], ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                           "algorithm.adv_estimator=gae"])
    assert cfg.critic.ppo_mini_batch_size == 2


@pytest.mark.parametrize("item, line", [
    ("actor.lr=inf", "actor.lr must be a finite number; got inf"),
    ("actor.lr=nan", "actor.lr must be a finite number; got nan"),
    ("critic.lr=-inf", "critic.lr must be a finite number; got -inf"),
    ("actor.entropy_coeff=nan", "actor.entropy_coeff must be a finite number; got nan"),
    ("actor.grad_clip=inf", "actor.grad_clip must be a finite number; got inf"),
])
def test_non_finite_floats_are_refused_in_one_line(item, line):
    with pytest.raises(ValueError) as info:
        load_config([], [item])
    assert str(info.value) == line


@pytest.mark.parametrize("items", [
    ["actor.ppo_mini_batch_size=5"],  # HybridRLConfig.__post_init__ (cross-section)
    ["actor.clip_ratio_c=0.5"],  # ActorConfig.__post_init__
    ["actor.lr=abc"],  # a value of the wrong type
])
def test_config_errors_are_raised_by_load_config_without_omegaconf_frames(items):
    with pytest.raises(ValueError) as info:
        load_config([], items)
    err = info.value
    assert "\n" not in str(err)
    frames = traceback.extract_tb(err.__traceback__)
    assert not [f.filename for f in frames if "omegaconf" in f.filename or f.filename == "<string>"]
    assert frames[-1].name == "load_config" or frames[-1].name == "_raise_all"
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
