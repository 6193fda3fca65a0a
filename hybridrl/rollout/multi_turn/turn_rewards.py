"""Per-turn rewards of multi-turn rollouts: a user hook scored on the training side.

Contract:
- ``turn_spans(loss_row, response_row)`` -> ``[(start, end, is_model)]``: the runs of one tail
  (``end`` exclusive) over its real tokens: model turns (loss mask 1) and the segments between
  them (tool output with the format's template tokens).
- ``build_turn_rewards(cfg, tokenizer)`` -> ``TurnRewards`` or None (``rollout.multi_turn``
  off, or ``rollout.multi_turn.turn_reward_fn`` empty). The hook is loaded like
  ``reward.reward_fn`` (``'package.module:function'`` or ``'file.py:function'``; a bad spec is
  one ValueError at start).
- ``TurnRewards(rb)`` -> [N, R] float32: for each row the hook is called as
  ``fn(turns=[{"role": "assistant" | "tool", "text": ...}, ...], data_source=...,
  ground_truth=..., extra_info=...)`` (the tail's runs in order, decoded; every run between
  model turns is a "tool" turn) and returns one number per assistant turn (a list or tuple), or
  one number (the last assistant turn's). Each number lands on the last token of its turn; the
  trainer adds the tensor to the outcome reward (``hybridrl.trainer.ppo``: GRPO-like estimators
  sum a row's rewards into its score, GAE sees each where it happens). A result of another
  type, length or a non-finite number raises ValueError naming the hook and the row. The hook
  runs on every rank that holds the row (TP and PP ranks alike): it must be a pure function
  of its arguments. Rows without a model token are skipped.
"""

from __future__ import annotations

import math
import numbers

import torch

from hybridrl.rewards.custom import load_reward_fn


def turn_spans(loss_row: torch.Tensor, response_row: torch.Tensor) -> list[tuple[int, int, bool]]:
    """Runs of model tokens and of other real tokens in one tail (module docstring)."""
    n = int(response_row.sum())
    model = loss_row[:n].bool().tolist()
    spans, start = [], 0
    for t in range(1, n + 1):
        if t == n or model[t] != model[start]:
            spans.append((start, t, model[start]))
            start = t
    return spans


class TurnRewards:
    """The per-turn reward hook over a rollout batch (module docstring)."""

    def __init__(self, spec: str, tokenizer) -> None:
        self.spec, self.fn, self.tokenizer = spec, load_reward_fn(spec), tokenizer

    def _numbers(self, value, turns: int, row: int) -> list[float]:
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not isinstance(value, (list, tuple)):
            values = [0.0] * (turns - 1) + values
        ok = len(values) == turns and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
            for v in values)
        if not ok:
            raise ValueError(f"turn reward function '{self.spec}' returned {value!r} for row "
                             f"{row}: expected {turns} finite number(s), one per assistant turn")
        return [float(v) for v in values]

    def __call__(self, rb) -> torch.Tensor:
        out = torch.zeros(rb.response_ids.shape, dtype=torch.float32)
        loss = rb.response_mask if rb.loss_mask is None else rb.loss_mask
        for i in range(len(rb)):
            spans = turn_spans(loss[i], rb.response_mask[i])
            ends = [end - 1 for start, end, is_model in spans if is_model]
            if not ends:
                continue
            turns = [{"role": "assistant" if is_model else "tool",
                      "text": self.tokenizer.decode(rb.response_ids[i, start:end].tolist())}
                     for start, end, is_model in spans]
            value = self.fn(turns=turns, data_source=rb.data_source[i],
                            ground_truth=rb.ground_truth[i], extra_info=rb.extra_info[i])
            for at, reward in zip(ends, self._numbers(value, len(ends), rb.rows[i])):
                out[i, at] += reward
        return out


def build_turn_rewards(cfg, tokenizer) -> TurnRewards | None:
    """The configured hook, or None (module docstring)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable or not mt.turn_reward_fn:
        return None
    return TurnRewards(mt.turn_reward_fn, tokenizer)
