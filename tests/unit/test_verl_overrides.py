"""verl command lines: the override lists of verl's megatron GSM8K PPO and GRPO examples load,
each key either translated or refused with the reason the table documents; Hydra's `+key=`,
`--config-name`; a string where a list is expected; every bad override reported at once."""

import pytest

from hybridrl.config import load_config
from hybridrl.config.loader import resolve_config_name
from hybridrl.config.verl.keys import VERL_RULES, rule_for
from hybridrl.config.verl.translate import translate_overrides

ARR = "actor_rollout_ref"
TRAIN = "['/d/gsm8k/train.parquet', '/d/math/train.parquet']"
TEST = "['/d/gsm8k/test.parquet', '/d/math/test.parquet']"

# verl examples/ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh (as the shell passes them)
VERL_PPO = [
    "algorithm.adv_estimator=gae", f"data.train_files={TRAIN}", f"data.val_files={TEST}",
    "data.train_batch_size=1024", "data.max_prompt_length=1024", "data.max_response_length=512",
    "data.filter_overlong_prompts=True", "data.truncation=error",
    f"{ARR}.model.path=Qwen/Qwen2-7B-Instruct", f"{ARR}.actor.optim.lr=1e-6",
    f"{ARR}.actor.ppo_mini_batch_size=256", f"{ARR}.actor.ppo_micro_batch_size_per_gpu=4",
    f"{ARR}.actor.megatron.pipeline_model_parallel_size=2",
    f"{ARR}.actor.megatron.tensor_model_parallel_size=2", f"{ARR}.actor.use_kl_loss=False",
    f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=4",
    f"{ARR}.rollout.tensor_model_parallel_size=4", f"{ARR}.rollout.name=vllm",
    f"{ARR}.rollout.gpu_memory_utilization=0.4",
    f"{ARR}.ref.megatron.pipeline_model_parallel_size=2",
    f"{ARR}.ref.megatron.tensor_model_parallel_size=2", "critic.optim.lr=1e-5",
    "critic.model.path=Qwen/Qwen2-7B-Instruct", "critic.ppo_micro_batch_size_per_gpu=4",
    "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0",
    'trainer.logger=["console","wandb"]', "trainer.project_name=verl_ppo_gsm8k_math_examples",
    "trainer.experiment_name=qwen2_7b_megatron", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
    "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=100",
]
# verl examples/grpo_trainer/run_qwen2-7b_math_megatron.sh
VERL_GRPO = [
    "algorithm.adv_estimator=grpo", f"data.train_files={TRAIN}", f"data.val_files={TEST}",
    "data.return_raw_chat=True", "data.train_batch_size=1024", "data.max_prompt_length=1024",
    "data.max_response_length=1024", "data.filter_overlong_prompts=True", "data.truncation=error",
    f"{ARR}.model.path=Qwen/Qwen2-7B-Instruct", f"{ARR}.model.use_fused_kernels=True",
    f"{ARR}.actor.optim.lr=1e-6", f"{ARR}.actor.ppo_mini_batch_size=256",
    f"{ARR}.actor.ppo_micro_batch_size_per_gpu=4",
    f"{ARR}.actor.megatron.pipeline_model_parallel_size=2",
    f"{ARR}.actor.megatron.tensor_model_parallel_size=2", f"{ARR}.actor.use_kl_loss=True",
    f"{ARR}.actor.kl_loss_coef=0.001", f"{ARR}.actor.kl_loss_type=low_var_kl",
    f"{ARR}.actor.entropy_coeff=0", f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=4",
    f"{ARR}.rollout.tensor_model_parallel_size=2", f"{ARR}.rollout.name=vllm",
    f"{ARR}.rollout.mode=async", f"{ARR}.rollout.gpu_memory_utilization=0.6",
    f"{ARR}.rollout.n=5", f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=4",
    f"{ARR}.ref.megatron.pipeline_model_parallel_size=2",
    f"{ARR}.ref.megatron.tensor_model_parallel_size=2", "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0", 'trainer.logger=["console","wandb"]',
    "trainer.project_name=verl_grpo_example_gsm8k_math", "trainer.experiment_name=qwen2_7b_megatron",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
    "trainer.total_epochs=15",
]


def _fails(overrides, *fragments, **kwargs):
    with pytest.raises(ValueError) as info:
        load_config([], list(overrides), **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    return str(info.value)


def test_verl_ppo_example_loads_with_verl_meaning():
    notices = []
    cfg = load_config([], VERL_PPO, world_size=8, notices=notices)
    assert len(VERL_PPO) == 34 and len(notices) == 1 and "\n" not in notices[0]
    assert cfg.algorithm.adv_estimator == "gae" and cfg.use_critic
    assert cfg.data.train_files == ["/d/gsm8k/train.parquet", "/d/math/train.parquet"]
    assert cfg.data.truncation == "drop"  # verl filters overlong prompts before truncating
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.gen.tp) == (2, 2, 4)
    assert cfg.check_world(8) == 2
    assert cfg.rollout.response_length == 512 and cfg.rollout.engine == "sglang"
    assert cfg.rollout.engine_kwargs == {"mem_fraction_static": 0.4}
    assert (cfg.actor.lr, cfg.critic.lr, cfg.critic.model_path) == (1e-6, 1e-5,
                                                                   "Qwen/Qwen2-7B-Instruct")
    assert cfg.ref.log_prob_micro_batch_size_per_gpu == 4
    assert cfg.critic.ppo_mini_batch_size == 256  # verl's critic default follows the actor
    assert cfg.trainer.logger == ["console", "wandb"]  # a sink hybridrl has is kept
    assert (cfg.trainer.save_freq, cfg.trainer.test_freq, cfg.trainer.total_epochs) == (20, 5, 100)
    for fragment in ("actor_rollout_ref.rollout.name -> rollout.engine ('vllm' -> 'sglang')",
                     "trainer.critic_warmup", "data.truncation=drop"):
        assert fragment in notices[0]


def test_verl_grpo_example_loads_with_verl_meaning():
    cfg = load_config([], VERL_GRPO, world_size=8)
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.use_critic
    assert cfg.rollout.n == 5 and cfg.rollout.response_length == 1024
    assert (cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) == (
        True, 0.001, "low_var_kl")
    assert cfg.parallel.gen.tp == 2 and cfg.parallel.nested
    assert cfg.check_world(8) == 2


@pytest.mark.parametrize("item", sorted(set(VERL_PPO + VERL_GRPO)))
def test_each_example_override_is_listed_and_accepted(item):
    """Each override alone: a rule of the table (or a same-named hybridrl key) and no problem."""
    translation = translate_overrides([item])
    key = item.split("=", 1)[0]
    assert rule_for(key) is not None, f"{key} missing from VERL_RULES"
    assert translation.problems == []


@pytest.mark.parametrize("rule", [r for r in VERL_RULES if r.kind == "refuse"],
                         ids=lambda r: r.verl)
def test_refused_keys_say_what_to_use(rule):
    _fails([f"{rule.verl}=1"], rule.verl, rule.note)


@pytest.mark.parametrize("rule", [r for r in VERL_RULES if r.kind == "ignore" and r.accept],
                         ids=lambda r: r.verl)
def test_ignored_keys_refuse_other_values(rule):
    accepted = rule.accept[0]
    assert translate_overrides([f"{rule.verl}={'null' if accepted is None else accepted}"]
                               ).problems == []
    _fails([f"{rule.verl}=something_else"], rule.verl, rule.note)


def test_refusals_from_real_verl_examples():
    # examples/grpo_trainer/run_deepseek671b_math_megatron_80gb.sh style lines
    _fails([f"+{ARR}.actor.megatron.override_transformer_config.apply_rope_fusion=True"],
           "override_transformer_config", "HF config.json")
    _fails(["trainer.critic_warmup=5"], "critic_warmup=5", "drop the key or set 0")


def test_memory_keys_of_verl_megatron_examples_translate():
    otc = f"+{ARR}.actor.megatron.override_transformer_config"
    cfg = load_config([], [f"{ARR}.actor.megatron.param_offload=True",
                           f"{ARR}.actor.megatron.grad_offload=True",
                           f"{ARR}.actor.megatron.optimizer_offload=True",
                           f"{ARR}.ref.megatron.param_offload=True",
                           "critic.megatron.optimizer_offload=True",
                           f"{ARR}.actor.megatron.use_distributed_optimizer=False",
                           f"{otc}.recompute_granularity=full",
                           f"{otc}.recompute_method=block", f"{otc}.recompute_num_layers=2"])
    assert cfg.actor.offload_parts == {"params", "grads", "optim"}
    assert cfg.ref.param_offload and cfg.critic.offload_parts == {"optim"}
    assert not cfg.actor.use_distributed_optimizer and not cfg.critic.use_distributed_optimizer
    assert (cfg.model.recompute_granularity, cfg.model.recompute_method,
            cfg.model.recompute_num_layers) == ("full", "block", 2)
    on = load_config([], [f"{ARR}.model.enable_gradient_checkpointing=True"])
    assert on.model.recompute_granularity == "full"


def test_reference_layout_must_equal_the_actors():
    cfg = load_config([], [f"{ARR}.actor.megatron.tensor_model_parallel_size=2",
                           f"{ARR}.ref.megatron.tensor_model_parallel_size=2", "model.path=/m"])
    assert cfg.parallel.tp == 2
    _fails([f"{ARR}.ref.megatron.tensor_model_parallel_size=2"], "actor's layout",
           "parallel.tp=1")


def test_world_size_from_verl_keys():
    _fails(VERL_PPO, "8*1 = 8 but the launcher started 4 ranks", world_size=4)
    assert load_config([], ["trainer.nnodes=2", "model.path=/m"], world_size=16)  # 8 GPUs/node
    load_config([], ["trainer.nnodes=2"])  # no world given: not checked


def test_hydra_plus_prefix_and_string_to_list():
    cfg = load_config([], ["+actor.lr=2e-6", "++data.train_files=/x/train.parquet",
                           "data.val_files=null", "trainer.logger=console"])
    assert cfg.actor.lr == 2e-6 and cfg.data.train_files == ["/x/train.parquet"]
    assert cfg.data.val_files == [] and cfg.trainer.logger == ["console"]


def test_lr_warmup_steps_translate_with_the_schedule():
    cfg = load_config([], [f"{ARR}.actor.optim.lr_warmup_steps=10"])
    assert (cfg.actor.warmup_steps, cfg.actor.lr_schedule) == (10, "warmup")
    cfg = load_config([], [f"{ARR}.actor.optim.lr_warmup_steps=10",
                           f"{ARR}.actor.optim.lr_scheduler_type=cosine"])
    assert (cfg.actor.warmup_steps, cfg.actor.lr_schedule) == (10, "cosine")
    assert load_config([], [f"{ARR}.actor.optim.lr_warmup_steps=-1"]).actor.warmup_steps == 0


def test_every_bad_override_at_once_with_did_you_mean():
    message = _fails(["actor.lrr=1", f"{ARR}.actor.clip_ratio_lo=0.1", "trainer.critic_warmup=3",
                      "~actor.lr", "actor.ppo_epochs=x", "rollout.temprature=0.5"],
                     "6 bad overrides:")
    lines = message.splitlines()[1:]
    assert len(lines) == 6
    assert "did you mean 'actor.lr'?" in lines[0]
    assert "verl's 'actor_rollout_ref.actor.clip_ratio_low'; hybridrl: 'actor.clip_ratio_low'" in lines[1]
    assert "critic_warmup" in lines[2] and "~key" in lines[3] and "actor.ppo_epochs" in lines[4]
    assert "did you mean 'rollout.temperature'?" in lines[5]


def test_config_name_resolution(tmp_path):
    (tmp_path / "mine.yaml").write_text("actor:\n  lr: 3.0e-4\n")
    assert resolve_config_name("mine", str(tmp_path)) == str(tmp_path / "mine.yaml")
    assert resolve_config_name("mine.yaml", str(tmp_path)) == str(tmp_path / "mine.yaml")
    assert resolve_config_name("ppo_megatron_trainer", "./config") is None
    assert resolve_config_name("demo_cpu").endswith("configs/demo_cpu.yaml")
    with pytest.raises(ValueError, match="no file"):
        resolve_config_name("nope", str(tmp_path))


def test_train_entrypoint_takes_hydra_flags_and_reports_all(capsys, tmp_path):
    from hybridrl import train

    args = train.parse_args(["--config-path=./config", "--config-name=ppo_megatron_trainer",
                             "+actor.lr=1e-6", "-cn", "demo_cpu"])
    assert (args.config_name, args.config_path, args.overrides) == ("demo_cpu", "./config",
                                                                    ["+actor.lr=1e-6"])
    code = train.main(["--config-name", "ppo_megatron_trainer", "actor.lrr=1",
                       "trainer.critic_warmup=2", "trainer.n_gpus_per_node=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("hybridrl.train: error: 2 bad overrides:")
    assert "did you mean 'actor.lr'?" in err and "critic_warmup" in err


def test_docs_from_verl_names_real_keys():
    """docs/from_verl.md's table: each verl key is in the table, each hybridrl key exists."""
    import os
    import re

    from hybridrl.config import HybridRLConfig
    from hybridrl.config.schema import key_kinds

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "from_verl.md"), encoding="utf-8") as f:
        rows = [line.split("|")[1:3] for line in f if line.startswith("| `")]
    kinds = key_kinds(HybridRLConfig)
    assert len(rows) >= 15
    token = re.compile(r"`([a-z][a-z_.]*[a-z_])`")  # whole backticked keys (no *, =, ...)
    checked = 0
    for verl_cell, ours_cell in rows:
        for key in token.findall(verl_cell):
            assert rule_for(key) is not None, key
            checked += 1
        for key in token.findall(ours_cell):
            assert key in kinds or key.startswith("rollout.engine_kwargs."), key
    assert checked >= 15
