"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the full vocab.

Contract:
- Each TP rank holds logits ``z[..., v]`` for its vocab slice ``[vocab_start, vocab_start + V_local)``
  of the padded vocabulary; ids ``>= vocab_size`` are padding and are excluded from the softmax.
- ``vocab_parallel_logprobs_entropy(logits_BTV, labels_BT, tp_group, vocab_start, vocab_size)``
  returns ``(logp_BT, entropy_BT)`` (entropy None unless asked), in fp32, equal on every TP rank:

      m   = max_v z_v                         (all-reduce MAX over TP; no gradient, a shift only)
      S   = sum_v exp(z_v - m)                (all-reduce SUM)
      lse = m + log S
      logp(y) = z_y - lse                     (z_y: all-reduce SUM of the owner's value, 0 elsewhere)
      H   = lse - sum_v p_v z_v,  p_v = exp(z_v - m) / S   (all-reduce SUM)

- Gradients are exact: every reduction is an all-reduce in the forward and the identity in the
  backward (each TP rank computes the same loss from replicated values, so the gradient of its own
  slice is local). With ``tp_group=None`` (or size 1) nothing is communicated.
- ``temperature`` divides the logits first (as the sampler did).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    """All-reduce SUM over ``group`` forward; identity backward (the loss is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sum_over(x: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)


def _max_over(x: torch.Tensor, group) -> torch.Tensor:
    x = x.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def vocab_parallel_logprobs_entropy(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    tp_group=None,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(labels) [B, T], entropy [B, T] or None) from this rank's vocab slice of the logits."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits_BTV.shape[:-1] != labels_BT.shape:
        raise ValueError(f"logits shape {tuple(logits_BTV.shape)} does not match labels shape "
                         f"{tuple(labels_BT.shape)} (expected [..., V_local] vs [...])")
    v_local = logits_BTV.shape[-1]
    z = logits_BTV.float()
    if temperature != 1.0:
        z = z / temperature
    ids_V = torch.arange(vocab_start, vocab_start + v_local, device=z.device)
    valid_V = ids_V < (vocab_size if vocab_size is not None else vocab_start + v_local)
    z_masked = z.masked_fill(~valid_V, float("-inf"))  # padding rows leave the softmax

    m_BT = _max_over(z_masked.max(dim=-1).values, tp_group)
    e_BTV = torch.exp(z_masked - m_BT.unsqueeze(-1))
    sum_exp_BT = _sum_over(e_BTV.sum(dim=-1), tp_group)
    lse_BT = m_BT + torch.log(sum_exp_BT)

    local_BT = labels_BT.long() - vocab_start
    owned_BT = (local_BT >= 0) & (local_BT < v_local)
    picked_BT = z.gather(-1, local_BT.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target_BT = _sum_over(picked_BT * owned_BT, tp_group)
    logp_BT = target_BT - lse_BT
    if not with_entropy:
        return logp_BT, None
    p_BTV = e_BTV / sum_exp_BT.unsqueeze(-1)
    pz_BT = _sum_over((p_BTV * z.masked_fill(~valid_V, 0.0)).sum(dim=-1), tp_group)
    return logp_BT, lse_BT - pz_BT


def reference_logprobs_entropy(
    logits_BTV: torch.Tensor, labels_BT: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocab single-process reference (the test oracle)."""
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    logp_BT = logp_BTV.gather(-1, labels_BT.long().unsqueeze(-1)).squeeze(-1)
    entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(dim=-1)
    return logp_BT, entropy_BT
