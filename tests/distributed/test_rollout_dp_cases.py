"""Rank-side bodies of tests/distributed/test_rollout_dp.py (module level for forkserver ranks).

A case is (name, overrides, action); every rank builds a ``PPOTrainer`` from ``test_trainer_cases``'s
tiny base config plus the case's overrides, runs ``fit()`` and returns the per-step metrics
(timing/perf keys dropped), the rows this rank held in the last step and its rollout transport
statistics ("fit"), or the RuntimeError message the run stops with ("error").
"""

from __future__ import annotations

import math

COUNTING_REWARD = '''
import os

def count(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.path.join(os.path.dirname(__file__), "calls.log"), "a") as f:
        f.write(f"{extra_info.get('index')}|{solution_str!r}\\n")
    return float(len(solution_str) % 3) / 2.0  # spread scores: GRPO groups get non-zero std


def broken(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("sandbox unreachable")
'''


def write_counting_reward(folder: str) -> str:
    """A reward function that logs every call to ``<folder>/calls.log``; its spec."""
    path = f"{folder}/count_reward.py"
    with open(path, "w") as f:
        f.write(COUNTING_REWARD)
    return f"{path}:count"


def _fit(rank, world, root, overrides):
    from tests.distributed.test_trainer_cases import _clean, _trainer, base_overrides

    trainer, _ = _trainer(rank, world, base_overrides(root) + overrides)
    history = trainer.fit()
    parts, lens = trainer.partition
    stats = trainer.transport
    return {"metrics": _clean(history), "rows": parts[trainer.groups.dp_rank],
            "n_rows": len(lens), "bytes_in": stats.bytes_in, "scalar_bytes": stats.scalar_bytes,
            "finite": all(math.isfinite(v) for m in history for v in m.values())}


def _error(rank, world, root, overrides):
    """One step that must fail: the RuntimeError's message on this rank (or None)."""
    try:
        _fit(rank, world, root, overrides)
    except RuntimeError as err:
        return str(err)
    return None


def run_cases(rank: int, world: int, root: str, cases: list) -> dict:
    actions = {"fit": _fit, "error": _error}
    return {name: actions[action](rank, world, root, overrides)
            for name, overrides, action in cases}
