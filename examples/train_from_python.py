"""Train with PPO from a Python program: prompts, reward and estimator are Python objects.

Contract: ``main(workdir, steps=2)`` (every rank of an initialized process group, same
arguments; with none, ``hybridrl.build_trainer`` starts a world of one) trains the builtin
2-layer llama for ``steps`` steps on ``prompts()`` (a list of verl-schema dicts, nothing written
to disk) with ``reward`` (verl's signature) and the estimator ``mean_baseline`` passed as
callables, and returns ``(history, estimator_calls)``. The caller's global random generators are
not touched (the trainer draws from states of its own). docs/api.md shows the body of
``main``; tests/distributed/test_train_from_python.py runs it on 2 gloo ranks.

    python examples/train_from_python.py            # one CPU rank, 2 steps
"""

from __future__ import annotations

import re

import torch

import hybridrl


def prompts(n: int = 32) -> list[dict]:
    """``n`` one-digit additions as verl rows (data_source, prompt, reward_model, extra_info)."""
    return [{"data_source": "example/sum",
             "prompt": [{"role": "user", "content": f"{i % 10}+{i // 10 % 10}="}],
             "reward_model": {"ground_truth": str(i % 10 + i // 10 % 10)},
             "extra_info": {"index": i}}
            for i in range(n)]


def reward(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """1 for the right last number, 0.2 for another number, 0 for none."""
    numbers = re.findall(r"-?\d+", solution_str)
    return 0.0 if not numbers else 1.0 if numbers[-1] == ground_truth else 0.2


def main(workdir: str = "outputs/train_from_python", steps: int = 2):
    calls: list = []

    @torch.no_grad()
    def mean_baseline(token_level_rewards, response_mask):  # REINFORCE, batch-mean baseline
        calls.append(tuple(token_level_rewards.shape))
        score = token_level_rewards.sum(dim=-1)
        adv = (score - score.mean())[:, None] * response_mask
        return adv, adv

    cfg = hybridrl.load_config([], [
        "model.num_layers=2", "data.max_prompt_length=40", "rollout.response_length=4",
        "data.train_batch_size=4", "rollout.n=2", "actor.lr=1e-3",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
        f"trainer.total_steps={steps}", "trainer.save_freq=-1", "trainer.test_freq=-1",
        f"trainer.output_dir={workdir}", "trainer.logger=[console]",
        "trainer.device=cpu", "trainer.resume=disable", "reshard.bucket_mb=1"])
    trainer = hybridrl.build_trainer(cfg, train_data=prompts(), reward_fn=reward,
                                     adv_estimator=mean_baseline)
    return trainer.fit(), calls


if __name__ == "__main__":
    history, calls = main()
    print(f"{len(history)} steps, estimator called {len(calls)} times, "
          f"score/mean {[round(m['critic/score/mean'], 3) for m in history]}")
