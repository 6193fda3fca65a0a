"""hybridrl.config: load order, unknown-key suggestions, value validation, cross-section rules."""

import dataclasses

import pytest

from hybridrl.config import (
    ActorConfig,
    HybridRLConfig,
    ParallelConfig,
    dump_config,
    load_config,
)

DEMO = "configs/demo_cpu.yaml"


def _fails(overrides, *fragments, yaml_paths=()):
    """load_config must raise ValueError whose message contains every fragment."""
    with pytest.raises(ValueError) as info:
        load_config(list(yaml_paths), list(overrides))
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# ---------------------------------------------------------------- defaults and precedence


def test_defaults_load_and_equal_direct_construction():
    cfg = load_config()
    assert cfg == HybridRLConfig()
    assert cfg.actor.clip_ratio_low == 0.2 and cfg.actor.clip_ratio_c == 3.0
    assert cfg.parallel.order == "tp-cp-ep-dp-pp"
    assert cfg.model.is_builtin and cfg.rollout.engine == "builtin"


def test_yaml_files_in_order_then_overrides_in_order(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("actor:\n  lr: 1.0e-4\n  ppo_epochs: 2\nrollout:\n  top_k: 5\n")
    second.write_text("actor:\n  lr: 2.0e-4\n")
    cfg = load_config([str(first), str(second)])
    assert (cfg.actor.lr, cfg.actor.ppo_epochs, cfg.rollout.top_k) == (2e-4, 2, 5)
    assert cfg.actor.clip_ratio_low == 0.2  # untouched keys keep the dataclass default
    cfg = load_config([str(first), str(second)], ["actor.lr=3e-4", "rollout.top_k=7",
                                                  "rollout.top_k=9"])
    assert (cfg.actor.lr, cfg.actor.ppo_epochs, cfg.rollout.top_k) == (3e-4, 2, 9)
    cfg = load_config([str(second), str(first)])
    assert cfg.actor.lr == 1e-4


def test_override_values_are_typed_and_lists_and_dicts_work():
    cfg = load_config(overrides=["data.train_files=[a.parquet,b.parquet]", "actor.lr=1e-5",
                                 "rollout.engine_kwargs.mem_fraction_static=0.7",
                                 "rollout.engine_kwargs.anything.nested=1",
                                 "kernels.use_compiled=false", "actor.use_kl_loss=true"])
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.actor.lr == 1e-5 and isinstance(cfg.actor.lr, float)
    assert cfg.rollout.engine_kwargs == {"mem_fraction_static": 0.7, "anything": {"nested": 1}}
    assert cfg.kernels.use_compiled is False and cfg.actor.use_kl_loss is True
    assert load_config(overrides=["kernels.use_compiled=auto"]).kernels.use_compiled == "auto"
    assert load_config(overrides=["model.path=/m", "model.path="]).model.path == ""


def test_result_is_real_frozen_dataclasses():
    cfg = load_config([DEMO])
    assert type(cfg.actor) is ActorConfig and type(cfg.parallel) is ParallelConfig
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.lr = 1.0


def test_empty_sections_and_files_are_no_ops(tmp_path):
    path = tmp_path / "empty_sections.yaml"
    path.write_text("actor:\nalgorithm:\n  kl_ctrl:\n# nothing else\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# only a comment\n")
    assert load_config([str(path), str(empty)]) == HybridRLConfig()


def test_interpolation_between_keys():
    assert load_config(overrides=["actor.lr=${critic.lr}"]).actor.lr == 1e-5


def test_dump_round_trips(tmp_path):
    cfg = load_config(["configs/llama70b_256gpu.yaml"], ["rollout.engine_kwargs.x=1"])
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(cfg))
    assert load_config([str(path)]) == cfg


# ---------------------------------------------------------------- unknown keys


def test_override_typo_suggests_the_right_key():
    message = _fails(["actor.clip_ratoi_low=0.1"])
    assert "unknown key 'actor.clip_ratoi_low'; did you mean 'actor.clip_ratio_low'?" in message


def test_yaml_typo_names_the_file_and_suggests(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("algorithm:\n  kl_ctrl:\n    target_kll: 0.2\n")
    _fails([], str(path), "'algorithm.kl_ctrl.target_kll'", "did you mean 'algorithm.kl_ctrl.target_kl'?",
           yaml_paths=[path])


@pytest.mark.parametrize("override, suggestion", [
    ("algoritm.gamma=0.9", "algorithm.gamma"),        # misspelt section
    ("clip_ratio_high=0.3", "actor.clip_ratio_high"),  # section missing
    ("trainer.save_frequency=3", "trainer.save_freq"),
    ("parallel.gen.tpp=2", "parallel.gen.tp"),
])
def test_more_typos(override, suggestion):
    _fails([override], f"did you mean '{suggestion}'?")


def test_every_unknown_key_is_reported_at_once(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text("actor:\n  lrr: 1.0\n  ppo_epoch: 2\n")
    _fails([], "'actor.lr'", "'actor.ppo_epochs'", yaml_paths=[path])


def test_verl_key_is_translated():
    cfg = load_config(overrides=["actor_rollout_ref.actor.clip_ratio=0.1",
                                 "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                                 "data.max_response_length=64"])
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.1, 0.1)
    assert cfg.rollout.response_length == 64 and cfg.parallel.gen.tp == 1


def test_malformed_inputs(tmp_path):
    _fails(["actor.lr"], "key=value")
    _fails(["actor=3"], "actor is a section")
    _fails(["data.train_files.x=a.parquet"], "data.train_files must be a list")
    _fails([], "does not exist", yaml_paths=[tmp_path / "missing.yaml"])
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    _fails([], "mapping", yaml_paths=[scalar])
    broken = tmp_path / "broken.yaml"
    broken.write_text("actor: [unclosed\n")
    _fails([], "not valid YAML", yaml_paths=[broken])
    with pytest.raises(TypeError):
        load_config("configs/demo_cpu.yaml")


# ---------------------------------------------------------------- bad values name the field


@pytest.mark.parametrize("override, fragments", [
    ("actor.lr=abc", ["actor.lr", "Float"]),
    ("actor.ppo_epochs=1.5", ["actor.ppo_epochs"]),
    ("actor.lr=0", ["actor.lr must be > 0"]),
    ("actor.clip_ratio_low=0", ["actor.clip_ratio_low must be in (0.0, 1.0]"]),
    ("actor.clip_ratio_c=1", ["actor.clip_ratio_c must be > 1.0"]),
    ("actor.loss_agg_mode=mean", ["actor.loss_agg_mode must be one of", "'seq-mean-token-sum-norm'"]),
    ("critic.loss_agg_mode=sum", ["critic.loss_agg_mode must be one of", "'token-mean'"]),
    ("actor.lr_schedule=linear", ["actor.lr_schedule must be one of", "'cosine'"]),
    ("actor.warmup_steps=5", ["actor.warmup_steps must be 0 when actor.lr_schedule"]),
    ("critic.lr_schedule=warmup", ["critic.warmup_steps must be >= 1"]),
    ("actor.adam_betas=[0.9]", ["actor.adam_betas"]),
    ("actor.kl_loss_type=k4", ["actor.kl_loss_type must be one of", "'low_var_kl+'"]),
    ("rollout.engine=vllm", ["rollout.engine must be one of", "'builtin'", "'sglang'"]),
    ("rollout.top_p=0", ["rollout.top_p"]),
    ("rollout.top_k=0", ["rollout.top_k must be -1 (off) or >= 1"]),
    ("rollout.n=0", ["rollout.n must be > 0"]),
    ("algorithm.adv_estimator=", ["algorithm.adv_estimator must name an estimator", "gae", "rloo"]),
    ("algorithm.gamma=1.5", ["algorithm.gamma must be in [0.0, 1.0]"]),
    ("algorithm.kl_penalty=full", ["algorithm.kl_penalty must be one of"]),
    ("algorithm.kl_ctrl.type=pid", ["algorithm.kl_ctrl.type must be one of", "'adaptive'"]),
    ("algorithm.kl_ctrl.target_kl=0", ["algorithm.kl_ctrl.target_kl must be > 0"]),
    ("reward.reward_fn=mymodule", ["reward.reward_fn must look like"]),
    ("reward.reward_fn_kwargs.k=1", ["reward.reward_fn_kwargs is set but reward.reward_fn is empty"]),
    ("reward.gsm8k_method=loose", ["reward.gsm8k_method must be one of", "'flexible'"]),
    ("reward.length_penalty_weight=0.1", ["reward.length_penalty_weight must be <= 0"]),
    ("data.truncation=right", ["data.truncation must be one of", "'error'", "'left'", "'drop'"]),
    ("data.synthetic.task=none", ["data.train_files is empty"]),
    ("data.synthetic.task=sudoku", ["data.synthetic.task must be one of", "'arithmetic'"]),
    ("trainer.logger=[console,neptune]", ["trainer.logger[] must be one of", "'jsonl'"]),
    ("trainer.resume=path", ["trainer.resume_path must be set exactly when trainer.resume"]),
    ("trainer.save_freq=0", ["trainer.save_freq must be -1 (never) or >= 1"]),
    ("trainer.device=tpu", ["trainer.device must be one of"]),
    ("trainer.kl_guard.max_kl=-1", ["trainer.kl_guard.max_kl must be >= 0"]),
    ("trainer.kl_guard.row_fraction=0", ["trainer.kl_guard.row_fraction must be in (0, 1]"]),
    ("trainer.kl_guard.row_fraction=1.5", ["trainer.kl_guard.row_fraction must be in (0, 1]"]),
    ("trainer.kl_guard.row_fraction=nan", ["trainer.kl_guard.row_fraction must be in (0, 1]"]),
    ("parallel.order=tp-dp-pp", ["parallel.order must be", "tp, cp, ep, dp, pp"]),
    ("parallel.cp=2", ["parallel.cp must be 1"]),
    ("parallel.ep=0", ["parallel.ep must be > 0"]),
    ("parallel.tp=0", ["parallel.tp must be > 0"]),
    ("parallel.gen.grouping=nested", ["parallel.gen.grouping must be one of", "'hybridflow'", "'vanilla'"]),
    ("reshard.strategy=nccl", ["reshard.strategy must be one of", "'zero_redundancy'", "'p2p'"]),
    ("reshard.bucket_mb=0", ["reshard.bucket_mb must be > 0"]),
    ("kernels.use_compiled=maybe", ["kernels.use_compiled must be one of", "'auto'"]),
    ("model.dtype=fp8", ["model.dtype must be one of", "'bf16'"]),
    ("model.num_query_groups=3", ["model.num_attention_heads (4) must be divisible by model.num_query_groups (3)"]),
    ("model.hidden_size=66", ["model.hidden_size (66)", "model.num_attention_heads (4)"]),
])
def test_bad_value_names_the_field(override, fragments):
    _fails([override], *fragments)


def test_sections_validate_when_built_directly():
    with pytest.raises(ValueError, match="actor.clip_ratio_high must be > 0"):
        ActorConfig(clip_ratio_high=-0.1)
    with pytest.raises(ValueError, match="parallel.dp must be >= 0"):
        ParallelConfig(dp=-1)


# ---------------------------------------------------------------- rules across sections


@pytest.mark.parametrize("overrides, fragments", [
    (["parallel.tp=4"], ["model.num_query_groups (2) must be divisible by parallel.tp (4)"]),
    (["parallel.gen.tp=2", "parallel.tp=2", "model.num_query_groups=1"],
     ["model.num_query_groups (1) must be divisible by parallel.tp (2)"]),
    (["parallel.pp=3"], ["model.num_layers (4) must be divisible by parallel.pp (3)"]),
    (["parallel.gen.tp=2"], ["parallel.gen.tp*parallel.gen.pp (2*1 = 2) must divide parallel.tp*parallel.pp (1*1 = 1)"]),
    (["model.num_query_groups=4", "parallel.tp=2", "parallel.pp=2", "parallel.gen.tp=4",
      "reshard.strategy=zero_redundancy"], ["reshard.strategy 'zero_redundancy'", "'p2p'"]),
    (["parallel.tp=2", "parallel.gen.tp=2", "parallel.gen.grouping=vanilla",
      "reshard.strategy=zero_redundancy"], ["parallel.gen.grouping 'hybridflow'"]),
    (["algorithm.adv_estimator=grpo", "rollout.n=1"], ["rollout.n must be >= 2"]),
    (["actor.ppo_mini_batch_size=128"], ["actor.ppo_mini_batch_size (128) must divide data.train_batch_size (64)"]),
    (["critic.ppo_mini_batch_size=48"], ["critic.ppo_mini_batch_size (48) must divide data.train_batch_size (64)"]),
    (["rollout.response_length=1000"], ["data.max_prompt_length + rollout.response_length (512 + 1000 = 1512)",
                                        "model.max_position_embeddings (1024)"]),
    (["rollout.engine=sglang", "trainer.device=cpu"], ["rollout.engine 'sglang' needs a GPU"]),
    (["parallel.dp=3"], ["data.train_batch_size*rollout.n (64*1) must be divisible by the DP size 3"]),
])
def test_cross_section_rules(overrides, fragments):
    _fails(overrides, *fragments)


def test_cross_section_rules_that_do_not_apply():
    # a non-nested generation layout is fine for the p2p/auto strategies
    cfg = load_config(overrides=["model.num_query_groups=4", "parallel.tp=2", "parallel.pp=2",
                                 "parallel.gen.tp=4", "reshard.strategy=auto"])
    assert not cfg.parallel.nested and cfg.parallel.micro_dp == 1
    # the critic's batch sizes are ignored without a critic (GRPO)
    cfg = load_config(overrides=["algorithm.adv_estimator=grpo", "rollout.n=2",
                                 "critic.ppo_mini_batch_size=48"])
    assert not cfg.use_critic
    # HF models: sizes come from config.json, so the builtin-size rules are skipped
    assert load_config(overrides=["model.path=/m", "parallel.tp=8"]).parallel.tp == 8


def test_check_world_derives_or_checks_dp():
    cfg = load_config([DEMO], ["parallel.tp=2", "parallel.pp=2"])
    assert cfg.check_world(4) == 1 and cfg.check_world(8) == 2
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by parallel.tp\*pp\*cp = 2\*2\*1 = 4"):
        cfg.check_world(6)
    pinned = load_config([DEMO], ["parallel.dp=2"])
    with pytest.raises(ValueError, match="parallel.dp = 2 does not fit world size 4"):
        pinned.check_world(4)
    with pytest.raises(ValueError, match="actor.ppo_micro_batch_size_per_gpu \\(5\\) must divide"):
        load_config([DEMO], ["actor.ppo_micro_batch_size_per_gpu=5"]).check_world(1)
    # dynamic batching lifts the micro-batch rule
    assert load_config([DEMO], ["actor.ppo_micro_batch_size_per_gpu=5",
                                "actor.use_dynamic_bsz=true"]).check_world(1) == 1


def test_sequence_parallel_without_tp_is_refused_at_load():
    from hybridrl.config import HybridRLConfig
    from hybridrl.config.model import ModelConfig

    with pytest.raises(ValueError, match=r"model\.sequence_parallel needs parallel\.tp > 1"):
        HybridRLConfig(model=ModelConfig(sequence_parallel=True))
    with pytest.raises(ValueError, match="model.recompute_granularity"):
        ModelConfig(recompute_granularity="sometimes")


def test_empty_mapping_override_clears_the_yaml_dict(tmp_path):
    """`reward.reward_fn_kwargs={}` clears what a YAML file set (a merge would keep it);
    a dotted key still adds one entry."""
    from hybridrl.config import load_config

    path = tmp_path / "kw.yaml"
    path.write_text("reward:\n  reward_fn: r.py:score\n  reward_fn_kwargs:\n    scale: 2\n"
                    "rollout:\n  engine_kwargs:\n    mem_fraction_static: 0.5\n")
    assert load_config([str(path)], []).reward.reward_fn_kwargs == {"scale": 2}
    cleared = load_config([str(path)], ["reward.reward_fn_kwargs={}", "rollout.engine_kwargs={}"])
    assert cleared.reward.reward_fn_kwargs == {} and cleared.rollout.engine_kwargs == {}
    added = load_config([str(path)], ["reward.reward_fn_kwargs.other=1"])
    assert added.reward.reward_fn_kwargs == {"scale": 2, "other": 1}
