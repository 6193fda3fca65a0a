"""Reshard training shards into a rollout engine: in place for the builtin engine, in the
engine format for any other; optionally with merged messages.

Contract:
- ``inplace_targets(plan, rank, named, engine, alias)``: the builtin engine's tensors (or
  parts) the reshard fills in place, by megatron gen-layout name (``alias``: a part that IS the
  rank's training tensor is not copied but read from it).
- ``sync_engine(plan, rank, shape, named, engine, dtype, device, alias, verify, coalescing)``
  (collective over the plan's ranks): runs ``plan`` from the rank's training tensors into
  ``engine`` and returns the executor's ``RunStats`` (details in its docstring).
- ``Coalescing``: caller-held state for merged messages (``hybridrl.reshard.coalesce``). Passed
  to ``sync_engine`` on the in-place path, the first sync agrees with the peers which transfers
  travel together and lays the engine's received parts out in the senders' memory order
  (``BuiltinEngine.arrange``), so that a run of training tensors that lie back to back (e.g.
  megatron DDP's parameter buffer) lands in a run of engine parts as ONE message; later syncs
  reuse the agreement (``Coalescing.merges``). Every rank of the plan passes one or none
  (with ``verify`` a mismatch raises on every rank instead of hanging, and so does a rank
  whose ``Coalescing`` is fresh while its peers' have agreed). Other engines ignore it.
  A sync that received in place with no temporary buffer is recorded (``executor.Replay``: its
  messages as flat views, its local row copies); the next sync replays it (post, copy, wait: no
  planning, targets or buckets rebuilt) when the training tensors and the engine's tensors are
  where they were (same addresses and shapes), else it runs and records again. A replaying
  rank posts exactly what ``run_plan`` would, so peers may replay or not independently.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from hybridrl.reshard.assemble import Assembler
from hybridrl.reshard.coalesce import Merges, agree
from hybridrl.reshard.executor import (
    Replay,
    RunStats,
    _local_error,
    check_same_plan,
    run_plan,
    train_sources,
)
from hybridrl.reshard.formats import engine_format, hf_name
from hybridrl.reshard.planner import Plan
from hybridrl.reshard.specs import LlamaShape

# a sender's hole up to this travels in the message (cheaper than a message of its own)
HOLE_MAX_BYTES = 256 << 10


@dataclasses.dataclass
class Coalescing:
    """Merged messages agreed at the first in-place sync (None before; see module doc), and the
    last sync recorded for replay with the addresses it was recorded at. The replay holds views
    of the training and engine storages it was recorded on: memory re-allocated elsewhere since
    stays alive until the next sync finds the addresses changed and drops it."""

    merges: Merges | None = None
    replay: Replay | None = None
    addresses: tuple = ()


def inplace_targets(plan, rank: int, named: dict, engine, alias: bool) -> dict:
    """Megatron gen-layout name -> the engine tensor (or its K parts) the reshard fills in place.

    An engine with ``blocks`` = K > 1 keeps each sharded tensor as K training-shard-shaped
    parts (``into=`` gets the list). With ``alias``, a part whose rows on this rank ARE the
    rank's training shard (same canonical rows, same storage shape: with K = train tp / gen tp
    the rank's own stage; with gen tp = train tp the same) is not copied at all: the engine
    reads the training tensor itself (``engine.alias``), and the reshard's local copy finds
    source and destination the same memory. Padding rows of the vocabulary are left as they are
    (the engine never reads them; its own buffers start zeroed), so an aliased training tensor
    keeps its own."""
    gen, train = plan.gen, plan.train
    into = {}
    for spec in plan.specs:
        iv = gen.interval(spec, rank)
        if iv is None:
            continue
        gname = spec.local_name(gen.pp, gen.num_layers)
        ename, parts, part_rows = _engine_parts(plan, spec, iv, engine)
        own = named.get(spec.local_name(train.pp, train.num_layers))
        shape = engine.block_shape(ename)
        targets = []
        for k, rows in enumerate(part_rows):
            block = k if parts > 1 else None
            same = (alias and own is not None and rows[1] > rows[0]
                    and train.interval(spec, rank) == rows and tuple(own.shape) == shape
                    and own.dtype == engine.dtype and own.device == engine.device)
            if same:
                engine.alias(ename, own, block)
                targets.append(own)
            else:
                targets.append(engine.buffer(ename, shape, block))
        into[gname] = targets if parts > 1 else targets[0]
    return into


@torch.no_grad()
def sync_engine(plan: Plan, rank: int, shape: LlamaShape, named: Mapping[str, torch.Tensor],
                engine: Any, dtype: torch.dtype, device: str | torch.device = "cpu",
                alias: bool = False, verify: bool = True,
                coalescing: Coalescing | None = None) -> RunStats:
    """Run ``plan`` from this rank's training tensors ``named`` into ``engine`` (collective).

    An engine with ``buffer`` (the builtin one; needs a gen-shard strategy) is filled in place:
    received rows land in its tensors, nothing is converted or buffered (``inplace_targets``;
    ``alias``: see there; ``coalescing``: see the module doc). Any other engine gets
    ``update_weights`` per flushed bucket in the engine format; the reshard's buffers live on
    ``device`` (the engine's). An engine with ``start_update(plan)`` (SGLang) is told the plan
    first and gets ``update_weights`` at every flush, empty ones included. ``finish_update``
    runs exactly once at the end. ``verify``: see ``run_plan`` (a caller that checked the plan
    once may skip the per-sync check)."""
    start = getattr(engine, "start_update", None)
    if start is not None:
        start(plan)
    in_place = hasattr(engine, "buffer") and plan.strategy in ("zero_redundancy", "p2p")
    if in_place and coalescing is not None and coalescing.replay is not None:
        if coalescing.addresses == _addresses(named, engine, alias):
            if verify:
                check_same_plan(plan, None, None, merged="run")
            stats = coalescing.replay.run()
            engine.finish_update()
            return stats
        coalescing.replay = None  # something moved: run (and record) again
    sources = train_sources(plan, rank, named)
    merges = None
    if in_place:
        def build():
            return Assembler(plan, rank, None, dtype=dtype, device=device, zero_padding=False,
                             into=inplace_targets(plan, rank, named, engine, alias),
                             spare=getattr(engine, "spare", None))
        if coalescing is not None and coalescing.merges is None:
            asm, verify = _agree(plan, rank, sources, engine, build, coalescing, device, verify)
        else:
            asm = build()
        merges = None if coalescing is None else coalescing.merges
    else:
        asm = Assembler(plan, rank, engine_format(shape, plan.gen, rank),
                        sink=engine.update_weights, dtype=dtype, device=device,
                        sink_every_flush=start is not None)
    replayable = in_place and coalescing is not None and hasattr(engine, "tensor_addresses")
    recorded: list = [] if replayable else None
    stats = run_plan(plan, rank, sources, asm, verify=verify, merges=merges, recorder=recorded)
    asm.result()
    if recorded:
        coalescing.replay, coalescing.addresses = recorded[0], _addresses(named, engine, alias)
    engine.finish_update()
    return stats


def _addresses(named: dict, engine, alias: bool) -> tuple:
    """Where the training tensors and the engine's tensors live now (a replay is valid only
    while this is unchanged: same memory, same shapes)."""
    return (alias, tuple((name, x.data_ptr(), tuple(x.shape)) for name, x in named.items()),
            engine.tensor_addresses())


def _agree(plan, rank, sources, engine, build, coalescing, device, verify):
    """First in-place sync with ``coalescing``: agree on merged messages, laying the engine's
    received parts out in the senders' memory order first (before any of its tensors is built,
    so the engine's memory is never held twice). Returns (the Assembler, verify still to do)."""
    if verify:  # everyone takes this path with the same plan and sound sources, before any
        # exchange (a source's shape problem is raised on every rank, not on its own alone)
        check_same_plan(plan, None, getattr(sources, "error", None), merged="agree")
    made = {}

    def arrange(peer_layouts):
        order, spare = _arrangement(plan, rank, engine, peer_layouts)
        engine.arrange(order, spare)
        asm = made["asm"] = build()
        if verify:  # inputs (dtype, targets) now, collectively: a bad one raises on every rank
            check_same_plan(plan, None, _local_error(plan, sources, asm)[0], merged="agree")
        return asm

    coalescing.merges = agree(plan, rank, sources, arrange, device=device)
    return made["asm"], False


def _engine_parts(plan, spec, interval, engine):
    """(engine name, number of parts, canonical rows of each part) of ``spec``'s gen piece
    ``interval`` on a rank: norms are one part, every sharded tensor ``engine.blocks``."""
    parts = 1 if spec.kind == "norm" else engine.blocks
    return hf_name(spec), parts, spec.part_intervals(*interval, parts, plan.gen.vocab_chunk)


def _part_of(plan, rank: int, engine, t):
    """((engine name, part), whether rows [t.lo, t.hi) of ``t.key`` start that part)."""
    spec = plan.spec(t.key)
    name, parts, rows = _engine_parts(plan, spec, plan.gen.interval(spec, rank), engine)
    k = next((k for k, (lo, hi) in enumerate(rows) if lo <= t.lo < hi), 0)
    return (name, k if parts > 1 else None), rows[k][0] == t.lo


def _arrangement(plan, rank: int, engine, peer_layouts):
    """The engine's received parts in the senders' memory order, and the scratch to leave after
    each so that it mirrors a sender's small hole (a norm this rank holds already, megatron's
    padding: at most ``HOLE_MAX_BYTES``) and the message can run through it."""
    rows = sorted((peer, lay[0] < 0, lay[:2], i, t) for peer, items in peer_layouts.items()
                  for i, (t, lay) in enumerate(items))
    order, starts = [], {}  # part -> (peer, sender storage, sender offset of its first row)
    for peer, _, (storage, offset), _, t in rows:
        part, first_row = _part_of(plan, rank, engine, t)
        if part not in starts:
            order.append(part)
            starts[part] = (peer, storage, offset) if first_row and storage >= 0 else None
    size = engine.dtype.itemsize
    spare = []
    for part, nxt in zip(order, order[1:] + [None]):
        a, b = starts[part], starts.get(nxt)
        numel = math.prod(engine.block_shape(part[0]))
        gap = b[2] - a[2] - numel if a and b and a[:2] == b[:2] else 0
        spare.append(gap if 0 < gap * size <= HOLE_MAX_BYTES else 0)
    return order, spare
