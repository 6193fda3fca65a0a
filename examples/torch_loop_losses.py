"""A plain PyTorch loop that uses hybridrl only for the RL math: GRPO advantages, the clipped PPO
policy loss, the fused low_var_kl kernel and the loss aggregation. No megatron, no process group.

Contract: ``main(steps, seed)`` trains a tiny bigram policy (an embedding table and one linear
layer, prompts of one token) to count on from the prompt token ``p``: ``p+1, p+2, ...`` (mod V)
over ``RESPONSE`` tokens; reward = fraction of right tokens; ``SAMPLES`` samples per prompt. Each step:
sample with the current policy (no grad: the rollout), GRPO advantages per prompt group
(``compute_advantage("grpo")``), then one PPO update on ``compute_policy_loss("vanilla")`` plus
``kl_coef * agg_loss(kl_penalty(logp, ref, "low_var_kl"))`` against the frozen initial policy.
Returns the mean reward of every step (it rises from chance, 1/V, toward 1).

    python examples/torch_loop_losses.py
"""

from __future__ import annotations

import copy

import torch

from hybridrl import agg_loss, compute_advantage, compute_policy_loss, kl_penalty

VOCAB, RESPONSE, PROMPTS, SAMPLES = 8, 4, 16, 4


class TinyPolicy(torch.nn.Module):
    """logits [B, T, V] for each position from the previous token (a bigram policy)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens_BT)))


def log_probs(policy, prompt_B, response_BT):
    """Log-prob [B, T] of each response token given the token before it."""
    inputs_BT = torch.cat([prompt_B[:, None], response_BT[:, :-1]], dim=1)
    logp_BTV = torch.log_softmax(policy(inputs_BT), dim=-1)
    return logp_BTV.gather(-1, response_BT[..., None]).squeeze(-1)


@torch.no_grad()
def rollout(policy, prompt_B, generator):
    """Sample RESPONSE tokens per prompt, one at a time."""
    token_B, out = prompt_B, []
    for _ in range(RESPONSE):
        probs_BV = torch.softmax(policy(token_B[:, None])[:, -1], dim=-1)
        token_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
        out.append(token_B)
    return torch.stack(out, dim=1)  # [B, T]


def main(steps: int = 60, seed: int = 0, lr: float = 0.05, kl_coef: float = 0.01) -> list[float]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    policy = TinyPolicy()
    ref = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    history = []
    for _ in range(steps):
        prompt_P = torch.randint(0, VOCAB, (PROMPTS,), generator=gen)
        prompt_B = prompt_P.repeat_interleave(SAMPLES)  # n samples per prompt, grouped
        response_BT = rollout(policy, prompt_B, gen)
        mask_BT = torch.ones_like(response_BT, dtype=torch.float32)
        target_BT = (prompt_B[:, None] + torch.arange(1, RESPONSE + 1)) % VOCAB
        score_B = (response_BT == target_BT).float().mean(dim=1)
        rewards_BT = torch.zeros_like(mask_BT)
        rewards_BT[:, -1] = score_B  # outcome reward on the last token, as the trainer does
        group_B = torch.arange(PROMPTS).repeat_interleave(SAMPLES)  # which prompt each row is
        adv_BT, _ = compute_advantage("grpo", rewards_BT, mask_BT, index=group_B)
        with torch.no_grad():
            old_BT = log_probs(policy, prompt_B, response_BT)
            ref_BT = log_probs(ref, prompt_B, response_BT)
        logp_BT = log_probs(policy, prompt_B, response_BT)
        pg_loss, _ = compute_policy_loss("vanilla", old_BT, logp_BT, adv_BT, mask_BT)
        kl = agg_loss(kl_penalty(logp_BT, ref_BT, "low_var_kl"), mask_BT, "token-mean")
        opt.zero_grad()
        (pg_loss + kl_coef * kl).backward()
        opt.step()
        history.append(float(score_B.mean()))
    return history


if __name__ == "__main__":
    rewards = main()
    print(f"mean reward: first 5 steps {sum(rewards[:5]) / 5:.3f}, "
          f"last 5 steps {sum(rewards[-5:]) / 5:.3f}")
