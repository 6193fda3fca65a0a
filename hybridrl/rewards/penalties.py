"""Optional reward shaping: length and repetition penalties (pure functions of token ids).

Contract. Both return a value in [0, 1] that the scorer multiplies by a (negative) weight,
-0.05 by default (:data:`DEFAULT_WEIGHT`), and adds to the score:
  length_fraction(n, max_len)   = min(n / max_len, 1)              (share of the budget used)
  repetition_fraction(ids, n)   = 1 - #distinct n-grams / #n-grams  (0 when fewer than n tokens)
and DAPO's overlong shaping (verl's DAPO reward manager), added to the score as it is:
  overlong_penalty(n, max_len, buffer, factor) = min(-(n - (max_len - buffer)) / buffer · factor, 0)
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_WEIGHT = -0.05


def length_fraction(num_tokens: int, max_response_length: int) -> float:
    if max_response_length < 1:
        raise ValueError(f"max_response_length={max_response_length}; allowed: >= 1")
    return min(num_tokens / max_response_length, 1.0)


def repetition_fraction(token_ids: Sequence[int], ngram: int = 3) -> float:
    if ngram < 1:
        raise ValueError(f"repetition ngram={ngram}; allowed: >= 1")
    ids = [int(t) for t in token_ids]
    total = len(ids) - ngram + 1
    if total <= 0:
        return 0.0
    distinct = len({tuple(ids[i : i + ngram]) for i in range(total)})
    return 1.0 - distinct / total


def overlong_penalty(num_tokens: int, max_response_length: int, buffer: int,
                     factor: float = 1.0) -> float:
    """DAPO's soft overlong penalty (<= 0): linear over the last ``buffer`` tokens of the budget."""
    if buffer < 1 or buffer > max_response_length:
        raise ValueError(f"reward.overlong_buffer={buffer}; allowed: 1..rollout.response_length "
                         f"({max_response_length})")
    expected = max_response_length - buffer
    return min(-(num_tokens - expected) / buffer * factor, 0.0)
