"""Mini-batches and token-budget micro-batches as index lists (pure functions, no torch state).

Contract. Every function returns lists of indices into the caller's batch, so the caller gathers
rows (``x[idx]``), runs them, and restores the original order with :func:`inverse_order`.

* ``split_mini_batches(batch_size, mini_batch_size, shuffle, seed)``: consecutive (optionally
  seeded-shuffled) chunks of ``mini_batch_size``; ``batch_size`` must be a multiple of it.
* ``karmarkar_karp(values, k, equal_size)``: the largest-differencing heuristic for a k-way
  partition with balanced sums. With ``equal_size`` every part has ``len(values) // k`` or one more
  items (sorted values are dealt k at a time, then partial partitions are merged pairwise, biggest
  part of one with the smallest of the other, largest spread first).
* ``plan_dp_partition(seqlens, dp_size)``: equal-count, token-balanced split across DP ranks.
* ``plan_micro_batches(seqlens, max_token_len)``: the fewest micro-batches whose PADDED size
  (``padded_tokens``: rows x the longest row, what a right-padded [b, T] batch really occupies)
  fits ``max_token_len`` (ppo_max_token_len_per_gpu). Rows are bucketed by length (longest first,
  each micro-batch filled with the next-longest rows), which also minimises padding. A sequence
  longer than the budget cannot fit anywhere: it gets a micro-batch of its own, is listed in
  ``plan.oversized`` and a warning is issued. No other micro-batch ever exceeds the budget.
  ``min_num_micro_batches`` splits the largest micro-batches in halves until there are that many.
  With ``packed=True`` (``model.pack_sequences``: a micro-batch is one pack of whole
  sequences, no padding) the budget counts REAL tokens: the sum of the rows' lengths. The plan
  takes k = ceil(total / budget) micro-batches (at least ``min_num_micro_batches``, at most one
  per row), splits the rows into k Karmarkar-Karp-balanced packs and raises k until every pack
  fits; an oversized sequence again runs alone. ``groups`` (packed only; a group id per row,
  e.g. the prompt group: ``model.share_prompts`` computes a prompt once per micro-batch) keeps
  a group's rows in one pack: the balanced units are whole groups (split into consecutive
  chunks within the budget where a group alone exceeds it), each weighing its rows' real
  tokens (a shared prompt counted per row: the budget holds without sharing too).
* ``plan_dp_micro_batches(seqlens, dp_size, max_token_len)``: both, with (by default) the same
  number of micro-batches on every rank (pipeline schedules need it); ``partition`` gives the
  ranks' indices instead of ``plan_dp_partition`` (rows already placed on their DP ranks);
  ``packed`` and ``groups`` (a group id per row of ``seqlens``) as above.
* ``computed_tokens(seqlens, micro_batch, packed)``: tokens a micro-batch's forward computes
  (``padded_tokens``, or the real tokens of a pack).
"""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class MicroBatchPlan:
    """Micro-batches (lists of indices into the caller's batch) and the oversized indices."""

    micro_batches: list[list[int]]
    oversized: list[int] = field(default_factory=list)


def split_mini_batches(
    batch_size: int, mini_batch_size: int, shuffle: bool = False, seed: int = 0
) -> list[list[int]]:
    """``batch_size // mini_batch_size`` index lists of ``mini_batch_size`` each."""
    if mini_batch_size < 1 or batch_size < 1 or batch_size % mini_batch_size:
        raise ValueError(
            f"ppo_mini_batch_size={mini_batch_size} must be >= 1 and divide the batch size "
            f"{batch_size}"
        )
    order = np.random.default_rng(seed).permutation(batch_size) if shuffle else range(batch_size)
    order = [int(i) for i in order]
    return [order[s : s + mini_batch_size] for s in range(0, batch_size, mini_batch_size)]


def _merge(a: list[tuple[int, list[int]]], b: list[tuple[int, list[int]]]):
    """Pair a's i-th largest part with b's i-th smallest; parts sorted by sum, descending."""
    merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
    merged.sort(key=lambda part: (-part[0], part[1]))
    return merged


def karmarkar_karp(values: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split ``range(len(values))`` into ``k`` parts with balanced sums of ``values``.

    Parts are returned with indices ascending, ordered by their smallest index (empty parts last).
    """
    if k < 1:
        raise ValueError(f"number of partitions k={k}; allowed: >= 1")
    if any(v < 0 for v in values):
        raise ValueError("karmarkar_karp: values must be >= 0 (sequence lengths)")
    items = sorted(((int(v), i) for i, v in enumerate(values)), reverse=True)
    if equal_size:
        items += [(0, -1)] * (-len(items) % k)  # dummies (index -1) even out the chunks
        chunks = [items[s : s + k] for s in range(0, len(items), k)]
        states = [[(v, [i]) for v, i in chunk] for chunk in chunks]
    else:
        states = [[(v, [i])] + [(0, [])] * (k - 1) for v, i in items]
    heap = [(-(s[0][0] - s[-1][0]), n, s) for n, s in enumerate(states)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = _merge(a, b)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    parts = [sorted(i for i in idx if i >= 0) for _, idx in heap[0][2]] if heap else []
    parts += [[] for _ in range(k - len(parts))]
    return sorted(parts, key=lambda p: (not p, p[0] if p else 0))


def plan_dp_partition(seqlens: Sequence[int], dp_size: int) -> list[list[int]]:
    """Indices for each DP rank: counts differ by at most one, token sums KK-balanced."""
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size}; allowed: >= 1")
    if len(seqlens) < dp_size:
        raise ValueError(f"{len(seqlens)} sequences cannot feed dp_size={dp_size} ranks")
    return karmarkar_karp(seqlens, dp_size, equal_size=True)


def padded_tokens(seqlens: Sequence[int], micro_batch: Sequence[int]) -> int:
    """Tokens a right-padded micro-batch occupies: its rows x its longest row."""
    return len(micro_batch) * max((int(seqlens[i]) for i in micro_batch), default=0)


def computed_tokens(seqlens: Sequence[int], micro_batch: Sequence[int], packed: bool) -> int:
    """Tokens the forward of ``micro_batch`` computes: a pack's real tokens, else padded."""
    if packed:
        return sum(int(seqlens[i]) for i in micro_batch)
    return padded_tokens(seqlens, micro_batch)


def _units(seqlens: Sequence[int], rows: list[int], max_token_len: int,
           groups: Sequence | None) -> list[list[int]]:
    """``rows`` as the planner's units: one row each, or (``groups``) each group's rows in
    consecutive chunks that fit the budget."""
    if groups is None:
        return [[i] for i in rows]
    by: dict = {}
    for i in rows:
        by.setdefault(groups[i], []).append(i)
    units = []
    for members in by.values():
        chunk, size = [], 0
        for i in members:
            if chunk and size + int(seqlens[i]) > max_token_len:
                units.append(chunk)
                chunk, size = [], 0
            chunk.append(i)
            size += int(seqlens[i])
        units.append(chunk)
    return units


def _packs(seqlens: Sequence[int], rows: list[int], max_token_len: int, min_count: int,
           groups: Sequence | None = None):
    """The fewest KK-balanced packs of ``rows`` (at least ``min_count``) within the budget."""
    if not rows:
        return []
    units = _units(seqlens, rows, max_token_len, groups)
    if len(units) < min(min_count, len(rows)):  # too few groups to fill the count: rows
        units = [[i] for i in rows]
    lens = [sum(int(seqlens[i]) for i in u) for u in units]
    k = min(max(-(-sum(lens) // max_token_len), min_count, 1), len(units))
    while True:
        parts = [[i for j in p for i in units[j]] for p in karmarkar_karp(lens, k) if p]
        if k >= len(units) or max(computed_tokens(seqlens, p, True) for p in parts) <= max_token_len:
            return parts
        k += 1


def _split_largest(parts: list[list[int]], seqlens: Sequence[int]) -> bool:
    """Split the micro-batch of largest padded size (2+ rows) in two halves; False if none."""
    splittable = [p for p in parts if len(p) > 1]
    if not splittable:
        return False
    big = max(splittable, key=lambda p: (padded_tokens(seqlens, p), -p[0]))
    parts.remove(big)
    half = len(big) // 2  # big is sorted by length, longest first: each half stays homogeneous
    parts += [big[:half], big[half:]]
    return True


def plan_micro_batches(
    seqlens: Sequence[int], max_token_len: int, min_num_micro_batches: int = 1,
    packed: bool = False, groups: Sequence | None = None,
) -> MicroBatchPlan:
    """Token-budget micro-batches over ``range(len(seqlens))`` (see module docstring).

    ``min_num_micro_batches`` asks for at least that many (capped at the number of sequences).
    """
    if max_token_len < 1:
        raise ValueError(f"ppo_max_token_len_per_gpu={max_token_len}; allowed: >= 1")
    if not seqlens:
        return MicroBatchPlan([])
    oversized = [i for i, n in enumerate(seqlens) if n > max_token_len]
    if oversized:
        warnings.warn(
            f"{len(oversized)} sequence(s) longer than ppo_max_token_len_per_gpu={max_token_len} "
            f"(lengths {[int(seqlens[i]) for i in oversized]}) each run alone in a micro-batch",
            stacklevel=2,
        )
    if packed:
        fitting = [i for i, n in enumerate(seqlens) if n <= max_token_len]
        want = max(min_num_micro_batches - len(oversized), 1)
        parts = [[i] for i in oversized] + _packs(seqlens, fitting, max_token_len, want, groups)
        return MicroBatchPlan(sorted((sorted(p) for p in parts), key=lambda p: p[0]), oversized)
    # longest first; each micro-batch takes the longest remaining row and as many of the next
    # (shorter) rows as its padded size allows: the fewest micro-batches, least padding
    order = sorted((i for i, n in enumerate(seqlens) if n <= max_token_len),
                   key=lambda i: (-int(seqlens[i]), i))
    parts: list[list[int]] = [[i] for i in oversized]
    start = 0
    while start < len(order):
        rows = max(max_token_len // max(int(seqlens[order[start]]), 1), 1)
        parts.append(order[start:start + rows])
        start += rows
    while len(parts) < min_num_micro_batches and _split_largest(parts, seqlens):
        pass
    micro = sorted((sorted(p) for p in parts), key=lambda p: p[0])
    return MicroBatchPlan(micro, oversized)


def plan_dp_micro_batches(
    seqlens: Sequence[int], dp_size: int, max_token_len: int, same_count: bool = True,
    partition: Sequence[Sequence[int]] | None = None, packed: bool = False,
    min_count: int = 1, groups: Sequence | None = None,
) -> list[MicroBatchPlan]:
    """Per DP rank, its micro-batches as indices into the global batch.

    With ``same_count`` every rank gets the largest count any rank needs (as far as its number of
    sequences allows), so all ranks run the same number of forward/backward steps. ``min_count``:
    at least that many micro-batches per rank where its rows allow (the trainer passes pp: a
    pipeline needs >= pp micro-batches to keep its bubble at (pp-1)/(2pp-1) or less).
    """
    ranks = plan_dp_partition(seqlens, dp_size) if partition is None else [list(p) for p in partition]

    def plan(min_count: int) -> list[MicroBatchPlan]:
        out = []
        for idx in ranks:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                local = plan_micro_batches(
                    [seqlens[i] for i in idx], max_token_len, min_count, packed=packed,
                    groups=None if groups is None else [groups[i] for i in idx])
            out.append(
                MicroBatchPlan(
                    [[idx[j] for j in mb] for mb in local.micro_batches],
                    [idx[j] for j in local.oversized],
                )
            )
        return out

    target = max(min_count, 1)
    plans = plan(target)
    while same_count and max(len(p.micro_batches) for p in plans) > target:
        # a forced larger count can (rarely) need one more part on some rank: iterate to a fixed
        # point; the target only grows and is bounded by the batch size, so this ends
        target = max(len(p.micro_batches) for p in plans)
        plans = plan(target)
    oversized = sorted(i for p in plans for i in p.oversized)
    if oversized:
        warnings.warn(
            f"sequences {oversized} are longer than ppo_max_token_len_per_gpu={max_token_len}; "
            "each runs alone in a micro-batch",
            stacklevel=2,
        )
    return plans


def inverse_order(index_lists: Sequence[Sequence[int]]) -> list[int]:
    """``inv`` such that ``concat(out_of_each_list)[inv]`` is in the original order.

    The lists must together hold every index 0..n-1 exactly once.
    """
    flat = [int(i) for idx in index_lists for i in idx]
    if sorted(flat) != list(range(len(flat))):
        raise ValueError("index lists must form a permutation of 0..n-1 (each index once)")
    inv = [0] * len(flat)
    for pos, i in enumerate(flat):
        inv[i] = pos
    return inv
