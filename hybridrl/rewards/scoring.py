"""Rule/custom reward dispatch by data_source, penalties, and batch scoring with metrics.

Contract. :data:`REWARD_FNS` is the registry of verl-signature functions
``fn(data_source, solution_str, ground_truth, extra_info, **kwargs) -> float | {"score": ...}``
keyed by data_source; builtins: "openai/gsm8k" and "gsm8k" (strict GSM8K), "gsm8k_flexible",
"hybridrl/arithmetic", "math" (boxed answer + math-verify: hybridrl.rewards.math) and "code"
(sandboxed execution against the row's tests: hybridrl.rewards.code). Register your own with ``REWARD_FNS.register(name, fn)``.

``RewardScorer(custom_fn, custom_fn_kwargs, fn_kwargs, ...)`` scores responses: a custom function
(``"module:function"``, a file path form, or a callable) takes every row, as in verl; otherwise
the row's data_source picks the registered function, called with ``fn_kwargs.get(data_source, {})``
(e.g. ``{"openai/gsm8k": {"method": "flexible"}}``). With ``length_penalty`` /
``repetition_penalty`` on, ``weight * fraction`` (hybridrl.rewards.penalties; weights -0.05 by
default) is added per sequence, and with ``overlong_buffer`` > 0 DAPO's overlong penalty
(``reward/overlong_penalty/mean``). ``score_batch`` returns ``(scores [B] float32, metrics)`` with
metrics ``critic/score/{mean,max,min}`` (final scores), ``reward/raw_score/mean`` (before
penalties), ``reward/{length,repetition}_penalty/mean`` when on, ``reward/<extra>/mean`` for the
numeric extras of dict results, ``reward/source/<data_source>/mean`` and
``timing_s/reward_row_{max,mean}`` (seconds one row's reward function took; a slow or stalling
answer shows there). ``score_tokens`` does
the same from generated token ids [B, R] + response mask (decoding them with the tokenizer).
A function that calls ``os.fork`` and returns in the child: that child is ended at once
(status 0, one warning line naming the function), the trainer's process goes on.
``build_reward_scorer(cfg)`` builds a scorer from the ``reward`` config section. Any exception
a reward function raises on a row (or an unusable result) becomes ``RewardFunctionError`` (a
``RuntimeError``: a training failure) naming the function, the row, its data_source and index.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridrl.registry import Registry
from hybridrl.rewards import arithmetic, gsm8k
from hybridrl.rewards import code as code_reward
from hybridrl.rewards import math as math_reward
from hybridrl.rewards.custom import check_call, failure_line, load_reward_fn, normalize_result
from hybridrl.rewards.penalties import (
    DEFAULT_WEIGHT,
    length_fraction,
    overlong_penalty,
    repetition_fraction,
)


def _gsm8k_flexible(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return gsm8k.compute_score(
        data_source, solution_str, ground_truth, extra_info, **{"method": "flexible", **kwargs}
    )


REWARD_FNS = Registry("reward function (by data_source)")
REWARD_FNS.register("openai/gsm8k", gsm8k.compute_score)
REWARD_FNS.register("gsm8k", gsm8k.compute_score)
REWARD_FNS.register("gsm8k_flexible", _gsm8k_flexible)
REWARD_FNS.register("hybridrl/arithmetic", arithmetic.compute_score)
REWARD_FNS.register("math", math_reward.compute_score)
REWARD_FNS.register("code", code_reward.compute_score)


def _end_forked_child(name: str) -> None:
    """The child of an ``os.fork`` in a reward function must not run the trainer's code."""
    sys.stderr.write(f"hybridrl: warning: reward function '{name}' forked and its child "
                     f"(pid {os.getpid()}) returned into the trainer; that child was ended "
                     "(use subprocess or multiprocessing in reward functions)\n")
    sys.stderr.flush()
    os._exit(0)


class RewardFunctionError(RuntimeError):
    """A reward function raised (or returned something unusable) on one row."""


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


class RewardScorer:
    """Scores (response, ground truth) pairs (see module docstring)."""

    def __init__(
        self,
        custom_fn: str | Callable | None = None,
        custom_fn_kwargs: dict | None = None,
        fn_kwargs: dict[str, dict] | None = None,
        length_penalty: bool = False,
        length_penalty_weight: float = DEFAULT_WEIGHT,
        repetition_penalty: bool = False,
        repetition_penalty_weight: float = DEFAULT_WEIGHT,
        repetition_ngram: int = 3,
        registry: Registry = REWARD_FNS,
        overlong_buffer: int = 0,
        overlong_penalty_factor: float = 1.0,
    ) -> None:
        self.overlong_buffer, self.overlong_penalty_factor = overlong_buffer, overlong_penalty_factor
        self.custom_name = (
            custom_fn if isinstance(custom_fn, str) else getattr(custom_fn, "__name__", "")
        )
        self.custom_fn = load_reward_fn(custom_fn) if isinstance(custom_fn, str) else custom_fn
        self.custom_fn_kwargs = dict(custom_fn_kwargs or {})
        if self.custom_fn is not None:  # a wrong signature: said at start, not on row 0
            check_call(self.custom_fn, self.custom_name, self.custom_fn_kwargs)
        self.fn_kwargs = {k: dict(v) for k, v in (fn_kwargs or {}).items()}
        self.length_penalty, self.length_penalty_weight = length_penalty, length_penalty_weight
        self.repetition_penalty = repetition_penalty
        self.repetition_penalty_weight = repetition_penalty_weight
        self.repetition_ngram = repetition_ngram
        self.registry = registry

    def score_one(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None
    ) -> tuple[float, dict[str, float]]:
        """``(score, extras)`` of one response, before penalties."""
        if self.custom_fn is not None:
            fn, name, kwargs = self.custom_fn, self.custom_name, self.custom_fn_kwargs
        else:
            fn, name = self.registry.get(data_source), data_source
            kwargs = self.fn_kwargs.get(data_source, {})
        pid = os.getpid()
        try:
            result = fn(data_source, solution_str, ground_truth, extra_info, **kwargs)
        finally:
            if os.getpid() != pid:  # a fork made in the function returned here: end it now
                _end_forked_child(name)
        return normalize_result(result, name)

    def _describe_failure(self, err: Exception, row: int, data_source: str, extra) -> str:
        name = self.custom_name or f"registered for {data_source!r}"
        index = (extra or {}).get("index") if isinstance(extra, dict) else None
        return failure_line(name, err, row, data_source, index)

    def _penalties(
        self, response_ids: Sequence[Sequence[int]] | None, max_response_length: int | None, n: int
    ) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        if not (self.length_penalty or self.repetition_penalty or self.overlong_buffer):
            return out
        if response_ids is None or len(response_ids) != n:
            raise ValueError("reward penalties need response_ids: one token list per response")
        if self.length_penalty:
            if max_response_length is None:
                raise ValueError(
                    "reward.length_penalty needs max_response_length (rollout.response_length)"
                )
            out["length_penalty"] = [
                self.length_penalty_weight * length_fraction(len(ids), max_response_length)
                for ids in response_ids
            ]
        if self.repetition_penalty:
            out["repetition_penalty"] = [
                self.repetition_penalty_weight * repetition_fraction(ids, self.repetition_ngram)
                for ids in response_ids
            ]
        if self.overlong_buffer:
            if max_response_length is None:
                raise ValueError(
                    "reward.overlong_buffer needs max_response_length (rollout.response_length)"
                )
            out["overlong_penalty"] = [
                overlong_penalty(len(ids), max_response_length, self.overlong_buffer,
                                 self.overlong_penalty_factor)
                for ids in response_ids
            ]
        return out

    def score_batch(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        data_sources: Sequence[str],
        extra_infos: Sequence[dict | None] | None = None,
        response_ids: Sequence[Sequence[int]] | None = None,
        max_response_length: int | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-sequence scores [B] (with penalties) and metrics (see module docstring)."""
        n = len(responses)
        if n == 0 or len(ground_truths) != n or len(data_sources) != n:
            raise ValueError(
                f"score_batch: {n} responses, {len(ground_truths)} ground truths, "
                f"{len(data_sources)} data sources; allowed: the same number (>= 1) of each"
            )
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        raw, extras, seconds = [], defaultdict(list), []
        for i in range(n):
            t0 = time.perf_counter()
            try:
                score, extra = self.score_one(
                    data_sources[i], responses[i], ground_truths[i], extra_infos[i]
                )
            except Exception as err:  # user code: one line naming function, source and row
                raise RewardFunctionError(self._describe_failure(err, i, data_sources[i],
                                                                 extra_infos[i])) from err
            raw.append(score)
            seconds.append(time.perf_counter() - t0)
            for k, v in extra.items():
                extras[k].append(v)
        penalties = self._penalties(response_ids, max_response_length, n)
        final = [raw[i] + sum(p[i] for p in penalties.values()) for i in range(n)]
        scores = torch.tensor(final, dtype=torch.float32)
        metrics = {
            "critic/score/mean": _mean(final),
            "critic/score/max": max(final),
            "critic/score/min": min(final),
            "reward/raw_score/mean": _mean(raw),
        }
        metrics.update({f"reward/{k}/mean": _mean(v) for k, v in penalties.items()})
        metrics.update({f"reward/{k}/mean": _mean(v) for k, v in extras.items()})
        by_source = defaultdict(list)
        for src, s in zip(data_sources, final):
            by_source[src].append(s)
        metrics.update({f"reward/source/{k}/mean": _mean(v) for k, v in by_source.items()})
        metrics["timing_s/reward_row_max"] = max(seconds)
        metrics["timing_s/reward_row_mean"] = _mean(seconds)
        return scores, metrics

    def score_tokens(
        self,
        tokenizer,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        ground_truths: Sequence[Any],
        data_sources: Sequence[str],
        extra_infos: Sequence[dict | None] | None = None,
        max_response_length: int | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """:meth:`score_batch` on generated tokens: ``response_ids``/``response_mask`` [B, R]
        (right-padded); each row's masked ids are decoded with ``skip_special_tokens=True``.
        ``max_response_length`` for the length penalty is the configured limit
        (rollout.response_length); R when not given."""
        if response_ids.dim() != 2 or response_mask.shape != response_ids.shape:
            raise ValueError(
                f"response_ids {tuple(response_ids.shape)} / response_mask "
                f"{tuple(response_mask.shape)}: allowed: equal [B, R] shapes"
            )
        ids = [row[mask.bool()].tolist() for row, mask in zip(response_ids, response_mask)]
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in ids]
        return self.score_batch(
            texts, ground_truths, data_sources, extra_infos, ids,
            int(response_ids.shape[1]) if max_response_length is None else max_response_length,
        )


def build_reward_scorer(cfg) -> RewardScorer:
    """A :class:`RewardScorer` from the ``reward`` config section (hybridrl.config.RewardConfig).

    ``gsm8k_method`` applies to the gsm8k data sources, ``format_score`` to the arithmetic task;
    ``reward_model_path`` is not handled here (the trainer builds the reward model and scores
    with it instead of this scorer).
    """
    gsm8k_kwargs = {"method": cfg.gsm8k_method}
    return RewardScorer(
        custom_fn=cfg.reward_fn or None,
        custom_fn_kwargs=dict(cfg.reward_fn_kwargs or {}),
        fn_kwargs={
            "openai/gsm8k": gsm8k_kwargs,
            "gsm8k": gsm8k_kwargs,
            "hybridrl/arithmetic": {"format_score": cfg.format_score},
        },
        length_penalty=cfg.use_length_penalty,
        length_penalty_weight=cfg.length_penalty_weight,
        repetition_penalty=cfg.use_repetition_penalty,
        repetition_penalty_weight=cfg.repetition_penalty_weight,
        overlong_buffer=cfg.overlong_buffer,
        overlong_penalty_factor=cfg.overlong_penalty_factor,
    )
