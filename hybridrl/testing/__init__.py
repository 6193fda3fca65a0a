"""Helpers other trainers' tests can use: run a function on N local gloo ranks.

Contract: ``run_on_ranks(fn, world_size, *args, timeout=...)`` (hybridrl.testing.dist) starts
``world_size`` local processes on a gloo group, calls ``fn(rank, world_size, *args)`` on each
and returns their results by rank; a failing rank raises ``RankFailure`` with its traceback, a
rank past ``timeout`` ``RankTimeout`` naming it (docs/api.md). hybridrl's own test harnesses (the
SGLang doubles and rank bodies) live in the repository's ``tests/support/``, not in the package.
"""

from hybridrl.testing.dist import RankFailure, RankTimeout, run_on_ranks

__all__ = ["RankFailure", "RankTimeout", "run_on_ranks"]
