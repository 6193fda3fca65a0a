"""Reward-model scoring: a critic-architecture model's value at the last response token.

Contract. ``RewardModelScorer(model)`` wraps any callable (a plain ``torch.nn.Module``; the trainer
scores with its sharded ``reward`` model instead, the same rule) with ``model(input_ids [B, T], attention_mask [B, T]) -> values [B, T]``
(a trailing dim of size 1 is squeezed). ``scorer(input_ids, attention_mask, response_mask)`` runs
it without gradients and returns ``scores [B]`` = the value at the last position where
``response_mask`` is 1. ``response_mask`` is either [B, T] (aligned with input_ids) or [B, R], the
response part at the end of the sequence (verl's layout: left-padded prompt, then response).
A row with an empty response scores 0.0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a [B, L] mask; -1 for an all-zero row."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    marked = torch.where(response_mask.bool(), positions, torch.full_like(positions, -1))
    return marked.max(dim=1).values  # [B]


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level scores [B, R]: ``scores[b]`` at the last response token of row b, 0 elsewhere."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    last = last_token_index(response_mask)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = scores.to(out.dtype)[rows]
    return out


def value_at_last_token(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values[b]`` at the last position where ``mask[b]`` is 1, as fp32 [B]; 0 for an all-zero
    row. ``values`` and ``mask`` are [B, L] on the same positions."""
    last = last_token_index(mask)
    picked = values.float().gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(last >= 0, picked, torch.zeros_like(picked))


class RewardModelScorer:
    """Score = the model's value at the last response token (see module docstring)."""

    def __init__(self, model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.model = model

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} / attention_mask "
                f"{tuple(attention_mask.shape)}: allowed: equal [B, T] shapes"
            )
        bsz, seq = input_ids.shape
        if (
            response_mask.dim() != 2
            or response_mask.shape[0] != bsz
            or response_mask.shape[1] > seq
        ):
            raise ValueError(
                f"response_mask {tuple(response_mask.shape)}: allowed: [B, R] with B={bsz}, R<={seq}"
            )
        full_mask = torch.zeros_like(input_ids, dtype=torch.bool)
        full_mask[:, seq - response_mask.shape[1] :] = response_mask.bool()
        with torch.no_grad():
            values = self.model(input_ids, attention_mask)
        if values.dim() == 3 and values.shape[-1] == 1:
            values = values.squeeze(-1)
        if values.shape != input_ids.shape:
            raise ValueError(
                f"reward model returned values {tuple(values.shape)}; allowed: [B, T] = "
                f"{tuple(input_ids.shape)} (or [B, T, 1])"
            )
        return value_at_last_token(values, full_mask)
