"""benchmarks/trl_settings.py: the TRL comparison sees every setting that changes the work.

The TRL side is read from a stand-in with GRPOConfig's attribute names (TRL is not a test
dependency); the values below are TRL 1.16's defaults where the test says so.
"""

from types import SimpleNamespace

import torch

from benchmarks.trl_settings import hybridrl_settings, settings_mismatch, trl_settings
from hybridrl.config import load_config


def _hybridrl():
    cfg = load_config(["configs/demo_cpu.yaml"], [
        "data.train_batch_size=12", "actor.ppo_mini_batch_size=12",
        "actor.ppo_micro_batch_size_per_gpu=4", "ref.log_prob_micro_batch_size_per_gpu=4"])
    return hybridrl_settings(cfg, 1, True, 1)


def _trl(**overrides):
    args = dict(per_device_train_batch_size=4, gradient_accumulation_steps=24,
                generation_batch_size=96, num_generations=8, num_iterations=1,
                max_completion_length=3, temperature=1.0, top_k=0, top_p=1.0, learning_rate=3e-3,
                lr_scheduler_type="constant", weight_decay=0.01, adam_beta1=0.9,
                adam_beta2=0.999, max_grad_norm=1.0, epsilon=0.2, epsilon_high=0.2,
                importance_sampling_level="token", loss_type="dapo", scale_rewards="group",
                beta=0.001, mixed="no", checkpointing=False)
    args.update(overrides)
    model = torch.nn.Linear(2, 2)
    model.is_gradient_checkpointing = args.pop("checkpointing")
    trainer = SimpleNamespace(args=SimpleNamespace(**args), model=model,
                              accelerator=SimpleNamespace(mixed_precision=args.pop("mixed")))
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return trl_settings(trainer, 1, True)
    finally:
        torch.set_num_threads(old)


def test_matched_settings_agree_key_for_key():
    ours, theirs = _hybridrl(), _trl()
    assert set(ours) == set(theirs)
    assert settings_mismatch(ours, theirs) == []


def test_trl_defaults_are_refused_naming_each_difference():
    # TRL 1.16's GRPOConfig defaults: bf16 autocast, gradient checkpointing, linear lr decay,
    # no weight decay; each must show as its own line
    lines = settings_mismatch(_hybridrl(), _trl(mixed="bf16", checkpointing=True,
                                                lr_scheduler_type="linear", weight_decay=0.0))
    keys = sorted(line.split(":")[0] for line in lines)
    assert keys == ["activation_recompute", "dtype", "lr_schedule", "weight_decay"]
    assert "autocast bf16" in " ".join(lines)


def test_one_work_knob_on_either_side_is_seen():
    assert [x.split(":")[0] for x in settings_mismatch(_hybridrl(), _trl(loss_type="grpo"))] == [
        "loss_agg"]
    assert [x.split(":")[0] for x in settings_mismatch(_hybridrl(), _trl(top_k=50))] == ["top_k"]
    cfg = load_config(["configs/demo_cpu.yaml"], [
        "data.train_batch_size=12", "actor.ppo_mini_batch_size=12",
        "actor.ppo_micro_batch_size_per_gpu=4", "ref.log_prob_micro_batch_size_per_gpu=4",
        "model.recompute_granularity=full"])
    assert [x.split(":")[0] for x in settings_mismatch(hybridrl_settings(cfg, 1, True, 1),
                                                       _trl())] == ["activation_recompute"]
