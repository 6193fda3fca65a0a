"""Score each sequence once in the whole job: spread over ranks, bounded in time, optionally pooled.

Contract:
- ``score_rows(scorer, items, timeout_s, pool)`` (no collective): ``items`` are
  ``RowItem(row, text, ids, ground_truth, data_source, extra_info)``; each row's reward function
  (``RewardScorer.score_one``) runs once, in this process (``pool`` None) or in a process pool,
  and must return within ``timeout_s`` seconds (0 = no limit). Returns one ``RowScore`` per item
  or, at the first timeout or exception (the rows after it are not waited for), the one-line
  error ``reward function 'NAME' <what> on
  row R (data_source 'S', index I)`` (R: the row in the step's batch, I: ``extra_info['index']``).
  A ``KeyboardInterrupt`` while it waits (Ctrl-C, or SIGTERM's ``hybridrl.exits.Terminated``)
  is not the function's failure: it propagates, so the run ends with 130 / 143.
- ``DistributedScorer(scorer, tokenizer, reward_cfg, max_response_length)`` with
  ``score(rows, response_ids, response_mask, ground_truth, data_source, extra_info, mp_index,
  mp_size)`` (collective over the world): the caller passes its DP replica's rows (global row
  indices, ascending) and its position among the replica's model-parallel ranks; the rank
  decodes and scores every ``mp_size``-th of them, then one ``all_gather_object`` of
  per-sequence scalars (score, raw score, penalties, numeric extras) gives every rank every
  row's record. Returns ``(scores [n_local] fp32 of the caller's rows, metrics over all rows)``
  with ``RewardScorer.score_batch``'s metric keys and values (the wall times
  ``timing_s/reward_row_{max,mean}`` of the rows' calls are this run's); an error on any rank raises
  ``RewardError`` (a ``RuntimeError``, never taken for a collective's timeout) with that line on
  every rank.
- ``global_score_metrics(scores, dp_group)``: ``critic/score/{mean,max,min}`` of per-row
  scores held by the DP ranks (a reward model's; gloo group, CPU scalars; None = this rank only).
- ``reward.num_workers`` > 0: a "forkserver" pool whose workers rebuild the scorer from the
  reward config (``build_reward_scorer``): functions registered at run time in the parent are not
  seen there; name them with ``reward.reward_fn`` instead. ``close()`` ends the pool.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing as mp
import threading
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.rewards.custom import failure_line


class RewardError(RuntimeError):
    """A reward function failed or timed out on a row (the message names function and row)."""


@dataclasses.dataclass
class RowItem:
    row: int
    text: str
    ids: list[int]
    ground_truth: Any
    data_source: str
    extra_info: dict | None


@dataclasses.dataclass
class RowScore:
    row: int
    final: float
    raw: float
    penalties: dict[str, float]
    extras: dict[str, float]
    data_source: str
    seconds: float = 0.0


def _call_with_timeout(fn, args: tuple, timeout_s: float):
    """``fn(*args)``; TimeoutError when it has not returned within ``timeout_s`` (> 0)."""
    if timeout_s <= 0:
        return fn(*args)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as err:  # handed to the caller below
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)  # a stuck call cannot be killed
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no result within {timeout_s:g} s (reward.timeout_s)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def fn_name(scorer, data_source: str) -> str:
    """The name a reward error shows: the custom function's spec, else the registered one's."""
    if scorer.custom_fn is not None:
        return scorer.custom_name or getattr(scorer.custom_fn, "__name__", "custom")
    try:
        return getattr(scorer.registry.get(data_source), "__name__", data_source)
    except ValueError:
        return data_source


def _error_line(scorer, item: RowItem, err: BaseException) -> str:
    if type(err).__name__ == "RewardFunctionError":  # already names the row and its source
        return str(err).splitlines()[0]
    index = (item.extra_info or {}).get("index") if isinstance(item.extra_info, dict) else None
    return failure_line(fn_name(scorer, item.data_source), err, item.row, item.data_source, index,
                        plain=isinstance(err, TimeoutError))


def _score_item(scorer, item: RowItem, timeout_s: float) -> tuple[float, dict, float] | str:
    """(score, extras, seconds the call took) or the error line."""
    try:
        t0 = time.perf_counter()
        score, extras = _call_with_timeout(scorer.score_one, (item.data_source, item.text,
                                                              item.ground_truth, item.extra_info),
                                           timeout_s)
        return score, extras, time.perf_counter() - t0
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while waiting for it: the run's, not its error
        raise
    except BaseException as err:  # any user error becomes one line on every rank
        return _error_line(scorer, item, err)


@functools.lru_cache(maxsize=1)
def _worker_scorer(reward_cfg_json: str):
    from hybridrl.config.algorithm import RewardConfig
    from hybridrl.rewards.scoring import build_reward_scorer

    return build_reward_scorer(RewardConfig(**json.loads(reward_cfg_json)))


def _pool_task(reward_cfg_json: str, item: RowItem, timeout_s: float):
    return _score_item(_worker_scorer(reward_cfg_json), item, timeout_s)


def score_rows(scorer, items: list[RowItem], timeout_s: float, pool=None,
               reward_cfg_json: str = "", max_response_length: int | None = None
               ) -> list[RowScore] | str:
    """Every item's score once (see the module docstring); an error line on failure."""
    results: list = []
    if pool is None:
        for item in items:  # stop at the first error: a hanging function costs timeout_s once
            results.append(_score_item(scorer, item, timeout_s))
            if isinstance(results[-1], str):
                return results[-1]
    else:
        pending = [pool.apply_async(_pool_task, (reward_cfg_json, item, timeout_s))
                   for item in items]
        # each call bounds itself in its worker; this only catches a worker that hangs anyway
        backstop = None if timeout_s <= 0 else timeout_s * (len(items) + 1) + 60
        for item, res in zip(items, pending):
            try:
                results.append(res.get(backstop))
            except mp.TimeoutError:
                results.append(_error_line(scorer, item, TimeoutError(
                    f"no result within {timeout_s:g} s (reward.timeout_s)")))
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM while waiting: the run's, not its error
                raise
            except BaseException as err:  # the worker could not run it at all
                results.append(_error_line(scorer, item, err))
            if isinstance(results[-1], str):
                return results[-1]  # the caller ends the pool: queued rows are dropped
    penalties = scorer._penalties([it.ids for it in items], max_response_length, len(items))
    out = []
    for k, (item, (raw, extras, seconds)) in enumerate(zip(items, results)):
        pen = {name: values[k] for name, values in penalties.items()}
        out.append(RowScore(item.row, raw + sum(pen.values()), raw, pen, extras, item.data_source,
                            seconds))
    return out


def summarize(records: list[RowScore]) -> dict[str, float]:
    """``RewardScorer.score_batch``'s metrics over ``records`` (in row order)."""
    def mean(values):
        return float(sum(values) / len(values)) if values else 0.0

    final = [r.final for r in records]
    metrics = {"critic/score/mean": mean(final), "critic/score/max": max(final),
               "critic/score/min": min(final), "reward/raw_score/mean": mean([r.raw for r in records])}
    pens, extras, sources = defaultdict(list), defaultdict(list), defaultdict(list)
    for r in records:
        for k, v in r.penalties.items():
            pens[k].append(v)
        for k, v in r.extras.items():
            extras[k].append(v)
        sources[r.data_source].append(r.final)
    metrics.update({f"reward/{k}/mean": mean(v) for k, v in pens.items()})
    metrics.update({f"reward/{k}/mean": mean(v) for k, v in extras.items()})
    metrics.update({f"reward/source/{k}/mean": mean(v) for k, v in sources.items()})
    metrics.update(row_time_metrics([r.seconds for r in records]))
    return metrics


def row_time_metrics(seconds: list[float]) -> dict[str, float]:
    """``timing_s/reward_row_{max,mean}``: the seconds one row's reward function took (under
    ``timing_s/``: wall times are not compared between runs)."""
    return {"timing_s/reward_row_max": max(seconds, default=0.0),
            "timing_s/reward_row_mean": float(sum(seconds) / len(seconds)) if seconds else 0.0}


def global_score_metrics(scores: torch.Tensor, dp_group=None) -> dict[str, float]:
    """Mean / max / min of the scores of every DP rank's rows."""
    s = scores.double().cpu()
    sums = torch.stack([s.sum(), torch.tensor(float(s.numel()), dtype=torch.float64)])
    peaks = torch.stack([s.max(), -s.min()])
    if dp_group is not None:
        dist.all_reduce(sums, group=dp_group)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=dp_group)
    return {"critic/score/mean": float(sums[0] / sums[1]), "critic/score/max": float(peaks[0]),
            "critic/score/min": float(-peaks[1])}


class DistributedScorer:
    """Once-per-sequence scoring over all ranks (see the module docstring)."""

    def __init__(self, scorer, tokenizer, reward_cfg, max_response_length: int | None = None):
        self.scorer, self.tokenizer = scorer, tokenizer
        self.timeout_s = float(getattr(reward_cfg, "timeout_s", 0.0))
        self.num_workers = int(getattr(reward_cfg, "num_workers", 0))
        self.cfg_json = json.dumps(dataclasses.asdict(reward_cfg)) if self.num_workers else ""
        self.max_response_length = max_response_length
        self.pool = None

    def _pool(self):
        if self.num_workers > 0 and self.pool is None:
            self.pool = mp.get_context("forkserver").Pool(self.num_workers)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None

    def score(self, rows: list[int], response_ids: torch.Tensor, response_mask: torch.Tensor,
              ground_truth, data_source, extra_info, mp_index: int = 0, mp_size: int = 1
              ) -> tuple[torch.Tensor, dict[str, float]]:
        """(scores [len(rows)] fp32, global metrics); collective over the world."""
        items = []
        for j in range(mp_index, len(rows), mp_size):
            ids = response_ids[j][response_mask[j].bool()].tolist()
            items.append(RowItem(rows[j], self.tokenizer.decode(ids, skip_special_tokens=True),
                                 ids, ground_truth[j], data_source[j], extra_info[j]))
        max_len = self.max_response_length or int(response_ids.shape[1])
        mine = score_rows(self.scorer, items, self.timeout_s, self._pool() if items else None,
                          self.cfg_json, max_len) if items else []
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        errors = [e for e in everyone if isinstance(e, str)]
        if errors:
            self.close()
            raise RewardError(errors[0])
        by_row = {r.row: r for part in everyone for r in part}
        missing = [row for row in rows if row not in by_row]
        assert not missing, f"rows {missing[:5]} were scored by no rank"
        scores = torch.tensor([by_row[row].final for row in rows], dtype=torch.float32)
        return scores, summarize([by_row[k] for k in sorted(by_row)])
