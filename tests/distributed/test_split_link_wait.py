"""Split placement: the wait for a generated batch (``hybridrl.rollout.split.link.recv_lengths`` /
``recv_rows``), the groups.

Two gloo ranks, a bridge group whose collective timeout is 1 s: a batch sent 3 s late is
received (the wait is bounded by ``rollout.timeout_s``, here 20 s, not by the bridge's
collective timeout), its row as int32 ids + fp32 log-probs (16 bytes for 2 tokens); a batch
that does not come within timeout_s (1 s) is one ``GenerationTimeout`` line naming the
generation rank, its replica, the last command and rollout.timeout_s.
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
    from hybridrl.rollout.split.link import (
        GenerationTimeout,
        recv_lengths,
        recv_rows,
        send_lengths,
        send_rows,
    )

    bridge = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    if rank == 1:  # the generation rank: late by 3 collective timeouts
        time.sleep(3)
        out = GenerationOutput(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]),
                               torch.tensor([[-0.5, -0.25]]))
        works = send_lengths(bridge, [0], out, 2.5, 7)
        works += send_rows(bridge, [0], out, [[0]], [0])
        for w in works:
            w.wait()
        dist.barrier()  # sends nothing more, and stays until rank 0's second wait timed out
        return None

    def who(src):
        return f"generation rank {src} (replica 0 of 1; last command: gen (request seed 3))"

    lens, gen_s, syncs = recv_lengths(bridge, [1], 1, 20.0, who)
    out, nbytes = recv_rows(bridge, [1], lens, [0], 0, 20.0, who)
    got = (out.response_ids.tolist(), out.logprobs.tolist(), gen_s, syncs, nbytes)
    try:
        recv_lengths(bridge, [1], 1, 1.0, who)
        err = None
    except GenerationTimeout as timeout:
        err = str(timeout)
    dist.barrier()  # was a 4 s sleep on rank 1: on a loaded machine it could leave (a closed
    return got, err  # connection, not a timeout) before this wait ended


def test_batch_wait_is_bounded_by_the_generation_timeout():
    got, err = run_on_ranks(_ranks, 2, timeout=120)[0]
    assert got == ([[5, 6]], [[-0.5, -0.25]], 2.5, 7, 16)  # 2 tokens x (int32 id + fp32)
    assert err is not None and "generation rank 1 (replica 0 of 1; last command: gen" in err
    assert "rollout.timeout_s=1 s" in err and "\n" not in err


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
