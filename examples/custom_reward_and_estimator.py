"""Plug a custom reward function and a custom advantage estimator into hybridrl's PPO trainer.

Contract: ``main(workdir, steps=2)`` (every rank of an initialized process group; a world of one
is started when none is) writes a small verl-schema dataset whose rows carry the data_source
``DATA_SOURCE``, registers

- ``partial_credit`` in ``hybridrl.REWARD_FNS`` under ``DATA_SOURCE`` (verl's signature:
  data_source, solution_str, ground_truth, extra_info -> float): 1 for the right final number,
  0.2 for any other number, 0 for none;
- an estimator ``"mean_baseline"`` with ``hybridrl.register_advantage_estimator``: the sequence
  score minus the batch mean, on every response token (REINFORCE with a batch baseline),

then runs ``PPOTrainer`` for ``steps`` steps with ``algorithm.adv_estimator=mean_baseline`` and
returns ``(history, estimator_calls)``. The same registrations work under torchrun when a script
makes them before calling ``hybridrl.train.main()`` (docs/api.md).

    python examples/custom_reward_and_estimator.py            # one CPU rank, 2 steps
"""

from __future__ import annotations

import os
import re

import torch

import hybridrl

DATA_SOURCE = "example/partial_credit"


def partial_credit(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\d+", solution_str)
    if not numbers:
        return 0.0
    return 1.0 if numbers[-1] == str(ground_truth) else 0.2


def write_data(folder: str) -> str:
    """A verl-schema parquet of one-digit additions tagged with DATA_SOURCE."""
    from hybridrl.data.arithmetic import make_rows
    from hybridrl.data.schema import write_rows

    rows = make_rows(32, seed=0, max_digits=1)
    for row in rows:
        row.data_source = DATA_SOURCE
    return write_rows(os.path.join(folder, "train.parquet"), rows)


def register(calls: list) -> None:
    """Register the reward function and the estimator (idempotent: override=True)."""
    hybridrl.REWARD_FNS.register(DATA_SOURCE, partial_credit, override=True)

    @hybridrl.register_advantage_estimator("mean_baseline", override=True)
    @torch.no_grad()
    def mean_baseline(token_level_rewards, response_mask):
        calls.append(tuple(token_level_rewards.shape))
        score_B = token_level_rewards.sum(dim=-1)  # [B]
        adv_BT = (score_B - score_B.mean())[:, None] * response_mask  # [B, T]
        return adv_BT, adv_BT


def config(workdir: str, train_file: str, steps: int):
    """A tiny CPU run (the builtin 2-layer llama) scored by data_source through the registry."""
    return hybridrl.load_config([], [
        "algorithm.adv_estimator=mean_baseline", f"data.train_files=[{train_file}]",
        "model.num_layers=2", "data.max_prompt_length=80", "rollout.response_length=4",
        "data.train_batch_size=4", "data.val_batch_size=4", "rollout.n=2", "actor.lr=1e-3",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
        f"trainer.total_steps={steps}", "trainer.save_freq=-1", "trainer.test_freq=-1",
        f"trainer.output_dir={workdir}", "trainer.logger=[console]",
        "trainer.device=cpu", "trainer.resume=disable", "reshard.bucket_mb=1"])


def main(workdir: str = "outputs/custom_reward_and_estimator", steps: int = 2):
    import torch.distributed as dist

    if not dist.is_initialized():  # plain `python examples/...`: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("gloo", rank=0, world_size=1)
    calls: list = []
    register(calls)
    train_file = write_data(os.path.join(workdir, "data"))
    cfg = config(workdir, train_file, steps)
    cfg.check_world(dist.get_world_size())
    train, gen = hybridrl.build_layout(cfg, dist.get_world_size())
    trainer = hybridrl.PPOTrainer(cfg, hybridrl.build_groups(train, gen))
    return trainer.fit(), calls


if __name__ == "__main__":
    history, calls = main()
    print(f"{len(history)} steps, estimator called {len(calls)} times, "
          f"score/mean {[round(m['critic/score/mean'], 3) for m in history]}")
