"""The wire references of benchmarks/reshard.py (run on its gloo ranks): the same bytes per rank
moved bare, with no planning, packing or consumer.

Contract: ``wire_methods(groups, zr_recv_bytes, local_bytes)`` returns timed callables for one
bare ``all_gather_into_tensor`` in the micro-DP group, one bare p2p batch of one buffer per
micro-DP peer, and that batch plus one plain copy of ``local_bytes`` (and the bytes per rank);
``plan_messages_method(plan, rank)`` one bare batch of the plan's own transfers (same sizes,
peers, order). ``max_over_ranks(x)``: the max of a number over all ranks (all_reduce).
"""

from __future__ import annotations


def max_over_ranks(x):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def wire_methods(groups, zr_recv_bytes, local_bytes=0):
    """The same bytes in the same micro-DP groups, bare: one all_gather; one p2p batch; and that
    batch plus one plain copy of the ``local_bytes`` a rank keeps (its own training rows, which
    every reshard into separate engine tensors must copy: the floor of what a reshard does)."""
    import torch
    import torch.distributed as dist

    dg, members, me = groups.size("micro_dp"), groups.members["micro_dp"], groups.rank
    per = int(max_over_ranks(zr_recv_bytes)) // max(1, dg - 1) // 4  # all_gather needs equal sizes
    x, y = torch.randn(per), torch.empty(per * dg)
    bufs = {peer: torch.empty(per) for peer in members if peer != me}

    def p2p():
        ops = [dist.P2POp(dist.isend, x, peer) for peer in bufs]
        ops += [dist.P2POp(dist.irecv, buf, peer) for peer, buf in bufs.items()]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()

    own, own_dst = torch.randn(local_bytes // 4), torch.empty(local_bytes // 4)

    def p2p_and_copy():
        p2p()
        own_dst.copy_(own)

    return {"wire: bare all_gather": lambda: dist.all_gather_into_tensor(y, x, group=groups.micro_dp),
            "wire: bare p2p batch": p2p,
            "wire: p2p batch + own-row copy": p2p_and_copy}, per * (dg - 1) * 4


def plan_messages_method(plan, rank):
    """The plan's own messages (every transfer of every bucket, same sizes, peers and order) as
    one bare p2p batch between plain buffers: the wire cost of the reshard's message count
    (gloo pays per message), without its bookkeeping, copies or buckets."""
    import torch
    import torch.distributed as dist

    sends = [(t, torch.randn(t.nbytes // 4)) for b in plan.buckets for t in b if t.src == rank]
    recvs = [(t, torch.empty(t.nbytes // 4)) for b in plan.buckets for t in b if t.dst == rank]

    def run():
        ops = [dist.P2POp(dist.isend, buf, t.dst) for t, buf in sends]
        ops += [dist.P2POp(dist.irecv, buf, t.src) for t, buf in recvs]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()

    return run, len(recvs)
