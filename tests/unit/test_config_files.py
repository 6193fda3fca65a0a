"""Every configs/*.yaml loads and validates; the examples mean what their comments say."""

import glob
import os

import pytest

from hybridrl.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_the_expected_examples_exist():
    names = {os.path.basename(p) for p in CONFIG_FILES}
    assert {"demo_cpu.yaml", "gsm8k_qwen2_7b.yaml", "llama70b_256gpu.yaml"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_file_loads_and_validates(path):
    cfg = load_config([path])
    assert cfg.data.train_files or cfg.data.synthetic.task != "none"


def test_demo_cpu_runs_on_one_to_four_ranks():
    cfg = load_config([os.path.join(ROOT, "configs", "demo_cpu.yaml")])
    assert cfg.model.is_builtin and cfg.rollout.engine == "builtin"
    assert cfg.trainer.device == "cpu" and not cfg.data.train_files
    assert cfg.data.synthetic.task == "arithmetic"
    assert [cfg.check_world(world) for world in (1, 2, 3, 4)] == [1, 2, 3, 4]
    # the 3D variant named in the file's comment is valid on 4 ranks
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.gen.tp=2",
              "reshard.strategy=zero_redundancy"]
    cfg3d = load_config([os.path.join(ROOT, "configs", "demo_cpu.yaml")], layout)
    assert cfg3d.check_world(4) == 1 and cfg3d.parallel.micro_dp == 2


def test_demo_vocab_covers_the_builtin_tokenizer():
    tokenizer = pytest.importorskip("hybridrl.data.tokenizer")
    cfg = load_config([os.path.join(ROOT, "configs", "demo_cpu.yaml")])
    assert cfg.model.vocab_size == tokenizer.CharTokenizer().vocab_size  # the trainer requires it
    assert load_config().model.vocab_size == tokenizer.CharTokenizer().vocab_size  # defaults too


def test_llama70b_is_the_256_gpu_layout():
    cfg = load_config([os.path.join(ROOT, "configs", "llama70b_256gpu.yaml")])
    par = cfg.parallel
    assert (par.tp, par.pp, par.dp, par.gen.tp, par.gen.pp) == (8, 4, 8, 4, 1)
    assert cfg.check_world(256) == 8
    assert par.nested and par.micro_dp == 8 and cfg.reshard.strategy == "zero_redundancy"
    with pytest.raises(ValueError, match="parallel.dp = 8 does not fit world size 128"):
        cfg.check_world(128)


def test_gsm8k_example_is_one_node():
    cfg = load_config([os.path.join(ROOT, "configs", "gsm8k_qwen2_7b.yaml")])
    assert cfg.check_world(8) == 2 and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.rollout.engine == "sglang" and cfg.rollout.engine_kwargs["mem_fraction_static"] == 0.6


EXAMPLE_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml")))


def test_dapo_and_gspo_examples_mean_what_they_say():
    names = {os.path.basename(p) for p in EXAMPLE_CONFIGS}
    assert {"dapo_qwen2.5_7b.yaml", "gspo_qwen3_8b.yaml"} <= names
    dapo = load_config([os.path.join(ROOT, "examples", "dapo_qwen2.5_7b.yaml")])
    assert dapo.algorithm.filter_groups.enable and dapo.parallel.dp == 1
    assert (dapo.actor.clip_ratio_low, dapo.actor.clip_ratio_high) == (0.2, 0.28)
    assert dapo.actor.loss_agg_mode == "token-mean" and dapo.reward.overlong_buffer == 4096
    assert dapo.check_world(8) == 1
    gspo = load_config([os.path.join(ROOT, "examples", "gspo_qwen3_8b.yaml")])
    assert gspo.actor.policy_loss == "gspo" and gspo.actor.loss_agg_mode == "seq-mean-token-mean"
    assert (gspo.actor.clip_ratio_low, gspo.actor.clip_ratio_high) == (3e-4, 4e-4)
    assert gspo.check_world(8) == 4
    for path in EXAMPLE_CONFIGS:  # every example YAML loads and validates
        assert load_config([path]).data.train_files
