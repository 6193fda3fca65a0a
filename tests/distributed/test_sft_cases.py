"""Rank-side bodies of the SFT tests (module level so forkserver ranks can import them)."""

from __future__ import annotations

import torch


def base_overrides(root: str) -> list[str]:
    """A tiny SFT: 2-layer llama, 1-digit additions, 8 pairs per step in 2-pair micro-batches."""
    return [
        "model.hidden_size=32", "model.num_layers=2", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.vocab_size=100",
        "model.max_position_embeddings=96", "data.max_prompt_length=80",
        "data.synthetic.max_digits=1", "data.synthetic.train_size=24",
        "data.synthetic.val_size=8", "data.val_batch_size=8", f"data.synthetic.dir={root}/data",
        "rollout.response_length=8", "sft.train_batch_size=8", "sft.micro_batch_size_per_gpu=2",
        "sft.lr=3e-3", "trainer.device=cpu", "reshard.bucket_mb=1",
        f"sft.output_dir={root}/sft", f"trainer.output_dir={root}",
        "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2",  # the RL run
        "actor.ppo_micro_batch_size_per_gpu=2", "algorithm.adv_estimator=grpo",
    ]


def _trainer(world: int, overrides: list[str]):
    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.train import build_layout
    from hybridrl.trainer.sft import SFTTrainer

    cfg = load_config([], overrides)
    train, gen = build_layout(cfg, world)
    torch.manual_seed(cfg.trainer.seed)
    return SFTTrainer(cfg, build_groups(train, gen), print_fn=lambda *a, **k: None)


def losses(rank: int, world: int, overrides: list[str]) -> list[tuple[float, float]]:
    """(loss, grad_norm) of each step of an SFT run; greedy validation ran after the last."""
    trainer = _trainer(world, overrides)
    return [(m["sft/loss"], m["sft/grad_norm"]) for m in trainer.fit()]


def accuracy(rank: int, world: int, overrides: list[str]) -> dict:
    """Greedy accuracy on the training prompts before and after SFT, and the exported model's
    accuracy when an RL trainer loads it (``model.path``)."""
    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.train import build_layout
    from hybridrl.trainer.ppo import PPOTrainer

    trainer = _trainer(world, overrides)
    before = trainer.validate()[0]["val/score/mean"]
    history = trainer.fit()
    folder = trainer.export(trainer.cfg.sft.output_dir + "/hf")
    cfg = load_config([], overrides + [f"model.path={folder}"])
    train, gen = build_layout(cfg, world)
    ppo = PPOTrainer(cfg, build_groups(train, gen), print_fn=lambda *a, **k: None)
    return {"before": before, "after": history[-1]["val/score/mean"],
            "first_loss": history[0]["sft/loss"], "last_loss": history[-1]["sft/loss"],
            "rl_start": ppo.validate()["val/score/mean"]}
