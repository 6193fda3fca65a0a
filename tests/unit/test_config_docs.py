"""docs/config.md is generated from the dataclasses and in sync; the verl key table is valid;
the config's allowed values match the modules that consume them."""

import dataclasses
import os
import subprocess
import sys

import pytest

from hybridrl.config import HybridRLConfig
from hybridrl.config.reference import DOC_PATH, REGEN_COMMAND, render_config_reference
from hybridrl.config.schema import key_kinds, walk
from hybridrl.config.verl.keys import VERL_KEYS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_docs_config_md_is_in_sync():
    with open(os.path.join(ROOT, DOC_PATH), encoding="utf-8") as f:
        committed = f.read()
    assert committed == render_config_reference(), (
        f"{DOC_PATH} is out of date with hybridrl/config/; run: {REGEN_COMMAND}")


def test_generator_script_check_mode():
    script = os.path.join(ROOT, "scripts", "gen_config_docs.py")
    done = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr


def test_every_key_is_documented():
    text = render_config_reference()
    for info in walk(HybridRLConfig):
        assert info.help or info.kind == "section", f"{info.key} has no help text"
        assert f"`{info.key}`" in text, f"{info.key} missing from {DOC_PATH}"
        if info.kind == "section":
            assert type(info.default).__doc__, f"{info.key}: section class lacks a docstring"


def test_defaults_live_only_in_dataclasses():
    # every field has a default, so a YAML file can only override, never be required
    for info in walk(HybridRLConfig):
        assert info.default is not dataclasses.MISSING, info.key


def test_verl_table_points_at_real_keys():
    kinds = key_kinds(HybridRLConfig)
    open_keys = [k for k, kind in kinds.items() if kind == "open"]
    verl_names = [verl for verl, _, _ in VERL_KEYS]
    assert len(verl_names) == len(set(verl_names)), "a verl key is listed twice"
    for verl, ours, _ in VERL_KEYS:
        for key in ours:
            ok = kinds.get(key) not in (None, "section") or any(
                key.startswith(k + ".") for k in open_keys)
            assert ok, f"verl key {verl} maps to {key}, which is not a hybridrl key"
    required = {"actor_rollout_ref.actor.clip_ratio", "actor_rollout_ref.actor.ppo_mini_batch_size",
                "algorithm.kl_ctrl.target_kl", "algorithm.adv_estimator",
                "actor_rollout_ref.rollout.tensor_model_parallel_size", "data.max_prompt_length",
                "trainer.total_epochs"}
    assert required <= set(verl_names)


def test_verl_keys_that_are_not_ours_get_the_translation():
    """Every 'set' rule of the table moves a verl value to its hybridrl keys (tests/unit/
    test_verl_overrides.py covers the other kinds)."""
    from hybridrl.config.verl.keys import VERL_RULES
    from hybridrl.config.verl.translate import translate_overrides

    for rule in VERL_RULES:
        if rule.kind != "set":
            continue
        translation = translate_overrides([f"{rule.verl}=7"])
        wanted = [f"{key}=7" for key in rule.ours]
        assert translation.items[:len(wanted)] == wanted, rule.verl


def test_allowed_values_match_their_consumers():
    """The config's choice lists equal the tuples of the modules that act on them."""
    from hybridrl.config import algorithm, data, roles

    kernels = pytest.importorskip("hybridrl.kernels")
    assert set(roles.KL_KINDS) == set(kernels.KL_KINDS)
    agg = pytest.importorskip("hybridrl.algos.agg")
    assert tuple(roles.LOSS_AGG_MODES) == tuple(agg.AGG_MODES)
    kl_control = pytest.importorskip("hybridrl.algos.kl_control")
    assert tuple(algorithm.KL_CTRL_TYPES) == tuple(kl_control.KL_CTRL_TYPES)
    dataset = pytest.importorskip("hybridrl.data.dataset")
    assert tuple(data.TRUNCATIONS) == tuple(dataset.TRUNCATION_MODES)
    gsm8k = pytest.importorskip("hybridrl.rewards.gsm8k")
    assert tuple(algorithm.GSM8K_METHODS) == tuple(gsm8k.METHODS)
    ppo = pytest.importorskip("hybridrl.algos")
    for name in algorithm.ADV_ESTIMATORS:
        ppo.ADVANTAGE_ESTIMATORS.get(name)  # raises ValueError when not registered
    ppo.POLICY_LOSSES.get(HybridRLConfig().actor.policy_loss)
