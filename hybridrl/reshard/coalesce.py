"""Fewer, larger messages: transfers between two ranks whose data follow each other in memory on
both sides travel as one message.

Contract:
- A side's *layout* of a transfer is ``(storage, offset, spare)``: an ordinal of the storage its
  piece (sender) or receive slot (receiver) lives in (per rank and call), the element offset in
  that storage, and (receiver only) how many elements right after the slot are scratch the
  receiver lets a message overwrite (``spare``: 0 unless the destination says so); ``NOWHERE``
  when it is not one contiguous run of memory.
- ``agree(plan, rank, sources, arrange, group=None, device="cpu") -> Merges`` is collective over
  every rank of the plan (each talks only to the ranks it exchanges transfers with). Round 1:
  every sender tells each receiver its layout of their common transfers. Then
  ``arrange(peer_layouts)`` runs on the receiver (``{src rank: [(transfer, layout), ...]}`` in
  plan order): it may lay its destination tensors out to follow the senders' memory (the
  builtin engine does, leaving the senders' small holes as spare memory) and returns the
  ``Assembler`` the transfers will land in (its ``slot`` and ``spare``). Round 2: every receiver
  tells each sender its layout. Both sides then derive the same ``Merges`` from the same two
  layouts: per bucket and rank pair, the transfers in the sender's memory order; a transfer
  joins the previous one's message when, on both sides, it starts the same number of elements
  ``g`` after the previous one ends and the receiver has ``g`` spare elements there (``g = 0``:
  back to back; ``g > 0``: the sender's hole, e.g. a norm the receiver already holds or
  megatron's padding, travels too and lands in the receiver's scratch). Each exchange is one
  int64 tensor per peer and direction (on ``device``: the CUDA device for NCCL).
- ``Merges.groups(k, transfers)``: this rank's transfers of bucket ``k`` as messages
  ``(transfers, gaps)`` in posting order (one isend/irecv each; ``gaps[i]``: elements between
  transfer i and i+1). Only buckets with a merge are stored; the rest keep one message per
  transfer, in plan order. ``messages`` / ``transfers``: how many this rank posts with /
  without merging; ``gap_bytes``: hole bytes its messages carry (sent, received).
- The merges are a fixed agreement: the executor re-checks the memory at every run
  (``message_view``) and, where a side's tensors moved since (re-allocated, offloaded and
  back), packs or unpacks that side's message through a temporary buffer. Results never depend
  on the memory staying put; only the zero-copy does. Both sides of a pair must run with the
  same ``Merges`` (``run_plan``'s plan check compares whether each rank runs merged).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from hybridrl.reshard.planner import Plan, Transfer

Layout = tuple[int, int, int]
NOWHERE: Layout = (-1, -1, 0)
Message = tuple[tuple[Transfer, ...], tuple[int, ...]]


def source_piece(plan: Plan, sources: dict, t: Transfer) -> torch.Tensor:
    """The sender's rows of transfer ``t`` (``sources``: see ``executor.run_plan``)."""
    view, lo0 = sources[t.key]
    return view.narrow(plan.spec(t.key).cut_dim, t.lo - lo0, t.hi - t.lo)


def layouts(tensors, spare: Callable | None = None) -> list[Layout]:
    """Layout per tensor (see module doc); NOWHERE if None or not contiguous."""
    ordinal: dict[int, int] = {}
    out = []
    for x in tensors:
        if x is None or not x.is_contiguous():
            out.append(NOWHERE)
            continue
        key = x.untyped_storage().data_ptr()
        out.append((ordinal.setdefault(key, len(ordinal)), x.storage_offset(),
                    0 if spare is None else spare(x)))
    return out


def message_view(tensors, gaps, spare: Callable | None = None) -> torch.Tensor | None:
    """One flat view over a message's tensors laid out with ``gaps`` between them in one
    storage (and, receiving, ``spare`` memory in every gap), else None."""
    first = tensors[0]
    if len(tensors) == 1:
        return first.view(-1) if first.is_contiguous() else None
    key, end = first.untyped_storage().data_ptr(), first.storage_offset()
    prev = None
    for x, gap in zip(tensors, (0, *gaps)):
        if (not x.is_contiguous() or x.dtype != first.dtype
                or x.untyped_storage().data_ptr() != key or x.storage_offset() != end + gap
                or (gap and spare is not None and spare(prev) < gap)):
            return None
        end, prev = x.storage_offset() + x.numel(), x
    return first.as_strided((end - first.storage_offset(),), (1,), first.storage_offset())


def message_numel(transfers, gaps, itemsize: int) -> int:
    return sum(t.nbytes for t in transfers) // itemsize + sum(gaps)


def singles(transfers) -> list[Message]:
    """One message per transfer, in their order (no merging)."""
    return [((t,), ()) for t in transfers]


@dataclasses.dataclass
class Merges:
    """This rank's agreed messages (see module doc)."""

    by_bucket: dict[int, dict[Transfer, Message]]  # k -> first transfer -> its message
    messages: int
    transfers: int
    gap_bytes: tuple[int, int] = (0, 0)  # hole bytes carried: (sent, received)

    def groups(self, k: int, transfers: list[Transfer]) -> list[Message]:
        merged = self.by_bucket.get(k)
        if merged is None:
            return singles(transfers)
        member = {t for msg, _ in merged.values() for t in msg}
        out = []
        for t in transfers:  # plan order of each message's first transfer
            if t in merged:
                out.append(merged[t])
            elif t not in member:
                out.append(((t,), ()))
        return out


def _messages(ts: list[Transfer], src: list[Layout], dst: list[Layout], itemsize: int):
    """Messages of one bucket and rank pair (see module doc)."""
    order = sorted(range(len(ts)), key=lambda i: (src[i][0] < 0, src[i][:2], i))
    runs: list[list[int]] = []
    gaps: list[list[int]] = []
    for i in order:
        if runs:
            j = runs[-1][-1]
            n = ts[j].nbytes // itemsize
            g = src[i][1] - src[j][1] - n
            if (min(src[i][0], dst[i][0]) >= 0 and src[i][0] == src[j][0] and dst[i][0] == dst[j][0]
                    and g >= 0 and dst[i][1] - dst[j][1] - n == g and g <= dst[j][2]):
                runs[-1].append(i)
                gaps[-1].append(g)
                continue
        runs.append([i])
        gaps.append([])
    return [(tuple(ts[i] for i in run), tuple(g)) for run, g in zip(runs, gaps)]


def _pairs(plan: Plan, rank: int):
    """peer -> [(bucket, transfer)] in plan order, for this rank's sends and its receives."""
    sends: dict[int, list] = {}
    recvs: dict[int, list] = {}
    for k, (s, r) in enumerate(plan.rank_buckets(rank)):
        for t in s:
            sends.setdefault(t.dst, []).append((k, t))
        for t in r:
            recvs.setdefault(t.src, []).append((k, t))
    return sends, recvs


def _exchange(mine: dict[int, list[Layout]], theirs: dict[int, list], group, device) -> dict:
    """Send each peer my layouts, receive each peer's (sizes known from the plan)."""
    into = {p: torch.empty(len(ts), 3, dtype=torch.int64, device=device) for p, ts in theirs.items()}
    ops = [dist.P2POp(dist.isend, torch.tensor(v, dtype=torch.int64, device=device).view(-1, 3),
                      peer, group) for peer, v in sorted(mine.items())]
    ops += [dist.P2POp(dist.irecv, x, peer, group) for peer, x in sorted(into.items())]
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    return {p: [tuple(r) for r in x.tolist()] for p, x in into.items()}


def agree(plan: Plan, rank: int, sources: dict, arrange: Callable, group=None,
          device="cpu") -> Merges:
    """Agree with every peer on merged messages (collective; see module doc)."""
    sends, recvs = _pairs(plan, rank)
    mine_out = {p: layouts(source_piece(plan, sources, t) for _, t in ts) for p, ts in sends.items()}
    src_in = _exchange(mine_out, recvs, group, device)
    asm = arrange({p: list(zip((t for _, t in ts), src_in[p])) for p, ts in recvs.items()})
    mine_in = {p: layouts((asm.slot(t.key, t.lo, t.hi) for _, t in ts), asm.spare)
               for p, ts in recvs.items()}
    dst_out = _exchange(mine_in, sends, group, device)

    by_bucket: dict[int, dict[Transfer, Message]] = {}
    messages = transfers = 0
    gap_elems = [0, 0]
    for side, (pairs, src_of, dst_of) in enumerate(((sends, mine_out, dst_out),
                                                    (recvs, src_in, mine_in))):
        for peer, kts in pairs.items():
            per_bucket: dict[int, list[int]] = {}
            for i, (k, _) in enumerate(kts):
                per_bucket.setdefault(k, []).append(i)
            for k, idx in per_bucket.items():
                msgs = _messages([kts[i][1] for i in idx], [src_of[peer][i] for i in idx],
                                 [dst_of[peer][i] for i in idx], plan.itemsize)
                messages, transfers = messages + len(msgs), transfers + len(idx)
                gap_elems[side] += sum(sum(g) for _, g in msgs)
                if len(msgs) < len(idx):
                    by_bucket.setdefault(k, {}).update({m[0][0]: m for m in msgs})
    return Merges(by_bucket, messages, transfers, (gap_elems[0] * plan.itemsize,
                                                   gap_elems[1] * plan.itemsize))
