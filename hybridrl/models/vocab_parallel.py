"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the full vocab.

Contract:
- Each TP rank holds logits ``x[..., v]`` for its slice ``[vocab_start, vocab_start + V_local)``
  of the padded vocabulary; ids ``>= vocab_size`` are padding (always a suffix of the padded
  vocabulary) and are left out of the softmax.
- ``vocab_parallel_logprobs_entropy(logits_BTV, labels_BT, tp_group, vocab_start, vocab_size)``
  returns ``(logp_BT, entropy_BT)`` (entropy None unless asked), in fp32, equal on every TP rank.
  With ``z = x / temperature`` over the real (non-padding) ids:

      m   = max_v z_v                         (all-reduce MAX over TP; a shift only)
      S   = sum_v exp(z_v - m)                (all-reduce SUM)
      lse = m + log S,   p_v = exp(z_v - lse)
      logp(y) = z_y - lse                     (z_y: all-reduce SUM of the owner's value, 0 elsewhere)
      H   = lse - sum_v p_v z_v               (all-reduce SUM)

- Backward is local to each vocab slice (every TP rank computes the same loss from the replicated
  outputs, so no communication is needed):

      d logp / d z_v = 1[v = y] - p_v          d H / d z_v = -p_v (log p_v + H)

  and ``d/dx = d/dz / temperature``. Only ``p`` (fp32, the local slice) is saved for backward.
- ``tp_group=None`` (or size 1) communicates nothing. ``reference_logprobs_entropy`` is the
  full-vocab single-process oracle.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelLogpEntropy(torch.autograd.Function):
    """(logp [B, T], entropy [B, T]) of the real-vocab prefix of this rank's logits slice."""

    @staticmethod
    def forward(ctx, logits_BTV, labels_BT, group, vocab_start, n_real, temperature):
        ctx.set_materialize_grads(False)  # unused entropy -> None grad: skip its [B, T, V] pass
        z_BTV = logits_BTV[..., :n_real].float() / temperature  # fp32 copy, real ids only
        shape = labels_BT.shape
        if n_real > 0:
            m_BT = z_BTV.max(dim=-1).values
        else:  # this slice holds padding only
            m_BT = torch.full(shape, float("-inf"), device=z_BTV.device)
        _all_reduce(m_BT, group, dist.ReduceOp.MAX)
        p_BTV = (z_BTV - m_BT.unsqueeze(-1)).exp_()  # unnormalized for now
        sum_exp_BT = _all_reduce(p_BTV.sum(dim=-1), group)
        lse_BT = m_BT + sum_exp_BT.log()
        p_BTV.div_(sum_exp_BT.unsqueeze(-1))  # softmax over the whole (real) vocabulary

        local_BT = labels_BT.long() - vocab_start
        owned_BT = (local_BT >= 0) & (local_BT < n_real)
        target_BT = torch.zeros(shape, device=z_BTV.device)
        if n_real > 0:
            picked = z_BTV.gather(-1, local_BT.clamp(0, n_real - 1).unsqueeze(-1)).squeeze(-1)
            target_BT = torch.where(owned_BT, picked, target_BT)
        _all_reduce(target_BT, group)
        pz_BT = _all_reduce((p_BTV * z_BTV).sum(dim=-1), group)
        entropy_BT = lse_BT - pz_BT
        ctx.save_for_backward(p_BTV, entropy_BT, local_BT, owned_BT)
        ctx.shape, ctx.n_real, ctx.temperature = logits_BTV.shape, n_real, temperature
        ctx.dtype = logits_BTV.dtype
        return target_BT - lse_BT, entropy_BT

    @staticmethod
    def backward(ctx, grad_logp_BT, grad_entropy_BT):
        p_BTV, entropy_BT, local_BT, owned_BT = ctx.saved_tensors
        grad_z_BTV = torch.zeros_like(p_BTV)
        if grad_entropy_BT is not None:  # -p (log p + H) * g_H
            grad_z_BTV = torch.xlogy(p_BTV, p_BTV).add_(p_BTV * entropy_BT.unsqueeze(-1))
            grad_z_BTV.mul_(-grad_entropy_BT.unsqueeze(-1))
        if grad_logp_BT is not None:  # (onehot - p) * g_logp
            grad_z_BTV.sub_(p_BTV * grad_logp_BT.unsqueeze(-1))
            if ctx.n_real > 0:
                idx = local_BT.clamp(0, ctx.n_real - 1).unsqueeze(-1)
                grad_z_BTV.scatter_add_(-1, idx, (grad_logp_BT * owned_BT).unsqueeze(-1))
        grad_x = torch.zeros(ctx.shape, dtype=ctx.dtype, device=p_BTV.device)
        grad_x[..., :ctx.n_real] = grad_z_BTV / ctx.temperature
        return grad_x, None, None, None, None, None


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
    real_end = vocab_start + v_local if vocab_size is None else vocab_size
    n_real = max(0, min(v_local, real_end - vocab_start))
    logp_BT, entropy_BT = _VocabParallelLogpEntropy.apply(
        logits_BTV, labels_BT.to(logits_BTV.device), tp_group, vocab_start, n_real,
        float(temperature))
    return logp_BT, entropy_BT if with_entropy else None


def reference_logprobs_entropy(
    logits_BTV: torch.Tensor, labels_BT: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocab single-process reference (the test oracle)."""
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    logp_BT = logp_BTV.gather(-1, labels_BT.long().unsqueeze(-1)).squeeze(-1)
    entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(dim=-1)
    return logp_BT, entropy_BT
