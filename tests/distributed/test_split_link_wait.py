"""Split placement: the wait for a generated batch (``hybridrl.rollout.split.link.recv_shares``), the groups.

Two gloo ranks, a bridge group whose collective timeout is 1 s: a batch sent 3 s late is
received (the wait is bounded by ``rollout.timeout_s``, here 20 s, not by the bridge's
collective timeout); a batch that does not come within timeout_s (1 s) is one
``GenerationTimeout`` line naming the generation rank and rollout.timeout_s.
Three ranks, split 2 + 1 at tp = pp = 1 (megatron's dp group spans both training ranks): the
training world is a group of its own, and a group created inside ``training_world`` is an error.
"""

from __future__ import annotations

from hybridrl.testing.dist import run_on_ranks


def _ranks(rank, world):
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from hybridrl.rollout.base import GenerationOutput
    from hybridrl.rollout.split.link import GenerationTimeout, recv_shares, send_share

    bridge = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    if rank == 1:  # the generation rank: late by 3 collective timeouts
        time.sleep(3)
        out = GenerationOutput(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]),
                               torch.tensor([[-0.5, -0.25]]))
        for w in send_share(bridge, [0], [0], out, 2.5, 7):
            w.wait()
        dist.barrier()  # sends nothing more, and stays until rank 0's second wait timed out
        return None
    out, gen_s, syncs = recv_shares(bridge, [1], 1, 0, 20.0)
    got = (out.response_ids.tolist(), out.logprobs.tolist(), gen_s, syncs)
    try:
        recv_shares(bridge, [1], 1, 0, 1.0)
        err = None
    except GenerationTimeout as timeout:
        err = str(timeout)
    dist.barrier()  # was a 4 s sleep on rank 1: on a loaded machine it could leave (a closed
    return got, err  # connection, not a timeout) before this wait ended


def test_batch_wait_is_bounded_by_the_generation_timeout():
    got, err = run_on_ranks(_ranks, 2, timeout=120)[0]
    assert got == ([[5, 6]], [[-0.5, -0.25]], 2.5, 7)
    assert err is not None and "generation rank 1" in err and "rollout.timeout_s=1 s" in err


def _groups(rank, world):
    import torch.distributed as dist

    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.parallel.split import build_split_groups, training_world

    split = build_split_groups(TrainLayout(world=2), 1, 1, timeout_s=30)
    if split.is_gen:
        return None
    # dp spans both training ranks (tp = pp = 1): the training world must be a group of its own
    own = all(g is not split.train_world for g in split.groups.groups.values())
    try:
        with training_world(split):
            dist.new_group([0, 1])  # only the training ranks would count it
    except RuntimeError as err:
        return own, str(err)
    return own, None


def test_training_world_is_its_own_group_and_makes_none():
    for own, err in run_on_ranks(_groups, 3, timeout=120)[:2]:
        assert own
        assert err is not None and "created inside training_world" in err
