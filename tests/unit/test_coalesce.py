"""The merge rule of hybridrl.reshard.coalesce, checked without a process group.

``_messages`` decides, from both sides' layouts, which transfers of one bucket and rank pair
travel together; ``message_view`` re-checks the memory at run time. Both are pure functions of
the layouts / tensors, so they are checked against hand-built layouts here; the executor and the
engine path (gloo ranks) are in tests/distributed/test_coalesce.py.
"""

from __future__ import annotations

import torch

from hybridrl.reshard.coalesce import NOWHERE, Merges, _messages, layouts, message_view
from hybridrl.reshard.planner import Transfer


def _ts(sizes):
    return [Transfer(f"k{i}", 0, 1, 0, 1, n * 4) for i, n in enumerate(sizes)]


def test_runs_follow_the_sender_order_and_need_both_sides_adjacent():
    ts = _ts([10, 20, 30])
    # sender: reverse order back to back (k2 at 0, k1 at 30, k0 at 50); receiver mirrors it
    src = [(0, 50, 0), (0, 30, 0), (0, 0, 0)]
    dst = [(0, 150, 0), (0, 130, 0), (0, 100, 0)]
    assert _messages(ts, src, dst, 4) == [((ts[2], ts[1], ts[0]), (0, 0))]
    # the receiver's k1 elsewhere: k2 alone, then k1 + k0 (adjacent on both sides)
    dst_split = [(0, 150, 0), (0, 130, 0), (1, 0, 0)]
    assert _messages(ts, src, dst_split, 4) == [((ts[2],), ()), ((ts[1], ts[0]), (0,))]
    # a side that is not one run of memory never merges
    assert _messages(ts, [NOWHERE] * 3, dst, 4) == [((t,), ()) for t in ts]


def test_a_hole_travels_only_into_the_receivers_spare_memory():
    ts = _ts([10, 20])
    src = [(0, 0, 0), (0, 14, 0)]  # a 4-element hole after k0 on the sender
    assert _messages(ts, src, [(0, 0, 4), (0, 14, 0)], 4) == [((ts[0], ts[1]), (4,))]
    assert _messages(ts, src, [(0, 0, 3), (0, 14, 0)], 4) == [((ts[0],), ()), ((ts[1],), ())]
    # same hole size on both sides is required
    assert _messages(ts, src, [(0, 0, 8), (0, 18, 0)], 4) == [((ts[0],), ()), ((ts[1],), ())]


def test_groups_keep_plan_order_of_first_transfers_and_singles_elsewhere():
    ts = _ts([1, 1, 1, 1])
    merges = Merges({0: {ts[2]: ((ts[2], ts[0]), (0,)), ts[1]: ((ts[1],), ())}}, 3, 4)
    got = merges.groups(0, ts)
    assert got == [((ts[1],), ()), ((ts[2], ts[0]), (0,)), ((ts[3],), ())]
    assert merges.groups(1, ts[:2]) == [((ts[0],), ()), ((ts[1],), ())]


def test_message_view_checks_the_memory_as_agreed():
    buf = torch.arange(20.0)
    a, b = buf[0:5], buf[8:12]
    assert message_view([a, b], (3,)).tolist() == list(range(12))
    assert message_view([a, b], (0,)) is None  # not where agreed
    assert message_view([a, b], (3,), spare=lambda x: 3) is not None
    assert message_view([a, b], (3,), spare=lambda x: 2) is None  # receiver: no scratch there
    assert message_view([a, torch.zeros(4)], (3,)) is None  # another storage
    assert message_view([buf.view(4, 5)[:, :2]], ()) is None  # not contiguous
    assert layouts([a, b, None, buf.view(4, 5)[:, :2]]) == [(0, 0, 0), (0, 8, 0), NOWHERE, NOWHERE]
