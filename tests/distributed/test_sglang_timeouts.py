"""One timeout around generation (issue 37 item 4), 2 gloo ranks, two gen replicas of one rank
each: the first collective after generate (``generate_partitioned``'s length all-reduce) is
preceded by a wait in the job's store for every engine's "done" key of that call, at most
``rollout.timeout_s``: the rank whose engine answered raises one line naming the late engine
(its gen-TP group and source rank) after about the timeout, not the process group's default.
The same wait with a timeout longer than the late engine completes (a control: the bound is
what fails the first case). One launch per case: a rank that raised leaves the group out of
step."""

from __future__ import annotations

import time
import types

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks

LATE_S = 8.0


class _SlowEngine:
    """An engine whose rank-1 replica answers ``LATE_S`` late."""

    def __init__(self, rank: int):
        self.rank = rank

    def generate(self, prompts, params):
        from hybridrl.rollout.base import GenerationOutput

        if self.rank == 1:
            time.sleep(LATE_S)
        n = len(prompts)
        return GenerationOutput(torch.ones(n, 2, dtype=torch.long),
                                torch.ones(n, 2, dtype=torch.long), torch.zeros(n, 2))


class _AfterReduce(Exception):
    pass


def _worker(rank: int, timeout_s: float):
    from hybridrl.rollout.worker import RolloutWorker

    w = object.__new__(RolloutWorker)  # only what generate_partitioned reads before partitioning
    w.rank, w.replica, w.n_replicas, w.is_src = rank, rank, 2, True
    w.gen = types.SimpleNamespace(tp=1, rank_at=lambda b, p, rep: rep)
    w.layout = types.SimpleNamespace(dp=2, coords=lambda r: {"dp": r})  # one rank per replica
    w.routing = None  # a dense model: no expert ids travel
    w.device, w.engine, w.timeout_s, w.generates = torch.device("cpu"), _SlowEngine(rank), \
        timeout_s, 0
    return w


def _rank(rank, world, timeout_s):
    """One case per launch: a rank that raised leaves its process group out of step."""
    from hybridrl.rollout.base import SamplingParams

    w = _worker(rank, timeout_s)

    def parts(lengths):
        raise _AfterReduce(lengths)

    t0 = time.monotonic()
    try:
        w.generate_partitioned([[1, 2], [3, 4]], SamplingParams(max_new_tokens=2), 7, parts)
        return ("returned", 0.0)
    except _AfterReduce as done:
        return ("reduced", done.args[0])
    except RuntimeError as err:
        return (str(err), time.monotonic() - t0)


@pytest.fixture(scope="module")
def results():
    return {case: run_on_ranks(_rank, 2, timeout_s, timeout=120)
            for case, timeout_s in (("bounded", 2.0), ("control", 60.0))}


@pytest.mark.slow
def test_a_late_engine_is_named_within_the_rollout_timeout(results):
    line, seconds = results["bounded"][0]
    assert line.startswith("rank 0: the response lengths after generate did not arrive within "
                           "rollout.timeout_s=2: late: the _SlowEngine of gen-TP group [1] "
                           "(source rank 1 has not finished generate call 1)"), line
    assert 1.5 < seconds < LATE_S - 1  # the 2 s bound, not the late engine's 8 s


@pytest.mark.slow
def test_a_timeout_above_the_delay_lets_the_results_through(results):
    for kind, lengths in results["control"]:
        assert kind == "reduced" and lengths == [2, 2], (kind, lengths)
