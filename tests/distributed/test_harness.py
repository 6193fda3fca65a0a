"""The gloo rank harness: results by rank, first failure's traceback, kills on failure/timeout.

The time bounds (< 60 s) tell "the harness ended the ranks" from "it waited for their 120 s
sleep (or the 100 s timeout)": starting 2-3 ranks takes seconds, so load cannot reach 60 s.
"""

import time

import pytest

from hybridrl.testing.dist import RankFailure, RankTimeout, run_on_ranks


def _sum_of_ranks(rank, world, scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world, t.item() * scale, torch.full((2, 3), float(rank))


def _rank1_raises(rank, world):
    import torch.distributed as dist

    dist.barrier()  # every rank is done joining: a rank that raised while a peer was still
    # joining made that peer fail its join first, and its failure was the one reported (load)
    if rank == 1:
        raise ZeroDivisionError("planted failure on rank 1")
    time.sleep(120)  # would block the test for minutes if the harness did not kill it


def _sleep(rank, world, seconds):
    time.sleep(seconds)


def test_results_in_rank_order():
    import torch

    out = run_on_ranks(_sum_of_ranks, 3, 2.0, timeout=120)
    assert [o[:3] for o in out] == [(r, 3, 2.0 * (0 + 1 + 2)) for r in range(3)]
    for r, o in enumerate(out):  # tensors come back as copies, after their rank has exited
        assert torch.equal(o[3], torch.full((2, 3), float(r)))


def test_first_failure_reports_traceback_and_kills_the_rest():
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_on_ranks(_rank1_raises, 3, timeout=120)
    assert "rank 1 failed" in str(err.value)
    assert "ZeroDivisionError: planted failure on rank 1" in str(err.value)
    assert time.monotonic() - start < 60  # ended, not waited for (module docstring)


def test_timeout_names_missing_ranks():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as err:
        run_on_ranks(_sleep, 2, 120, timeout=3)
    assert "[0, 1]" in str(err.value)
    assert time.monotonic() - start < 60  # ended, not waited for (module docstring)


def _rank0_exits_silently(rank, world):
    import os

    import torch.distributed as dist

    dist.barrier()  # every rank is done joining (rank 0 hosts the store: leaving earlier can make
    # a peer fail its own join first, and that failure would be the one reported)
    if rank == 0:
        os._exit(0)  # no result, exit status 0
    time.sleep(120)


def test_silent_exit_is_reported_not_waited_for():
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_on_ranks(_rank0_exits_silently, 2, timeout=100)
    assert "rank 0 exited with code 0" in str(err.value)
    assert time.monotonic() - start < 60  # ended, not waited for (module docstring)
