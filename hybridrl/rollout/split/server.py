"""The generation ranks' side of a split placement: an engine that serves the training ranks.

Contract:
- ``serve(cfg, split)`` runs on every generation rank (``split``: the rank's
  ``hybridrl.parallel.split.SplitGroups``) until rank 0 says ``stop``; returns the number of
  batches generated. First it receives the model description from rank 0 (command group:
  ``RemoteRollout``'s constructor sends it) and builds its replica's engine
  (``rollout.split.engine.build_split_engine``: ``rollout.engine`` builtin on its gen shard and
  gen TP group ``split.gen_tp``, or one SGLang Engine per replica; on ``split.device()``;
  replica = its gen_tp consecutive ranks), empty until the first sync. Then, per command
  (``hybridrl.rollout.split.link.Command``; with ``rollout.multi_turn.enable`` each ``gen``
  runs the agent loop around the engine, ``multi_turn.loop_engine_of``, and the tails travel
  like any response): ``sync``: the split plan over the bridge into the
  engine (``SplitEngine.receive_weights``: builtin in place, SGLang pushed bucket by bucket),
  then ``finish_update``; ``gen``: samples its
  replica's share; the replica's first rank keeps the rows (per request seed) and posts every
  training rank their lengths with the number of syncs it has received (``link.send_lengths``:
  the sends complete while the next commands are awaited, so several requests may be
  generated ahead); ``handoff``: the first rank sends each training rank the rows of its DP
  replica it holds (``link.send_rows``) and forgets the batch unless ``drop`` is false (a
  checkpoint's fetch); ``stop``: returns once every send has completed.
- It calls no collective on the default group; every wait is on the command group, the bridge
  (weights), the hand-off group (batches: ``split.handoff``, else the bridge) or its gen TP
  group. The wait for the next command (command group) lasts up to a day
  (``hybridrl.parallel.split.COMMAND_TIMEOUT_S``: a training step may be long), so a training
  rank that fails does not end it by a timeout: torchrun stops it when that rank exits (named
  by the entrypoint's phase board). The bridge and gen TP waits have the collective timeout.
"""

from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

from hybridrl.rollout.sampling import request_seed
from hybridrl.rollout.split.engine import build_split_engine
from hybridrl.rollout.split.link import replica_rows, send_lengths, send_rows


def receive_command(split):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=split.command)
    return box[0]


def serve(cfg, split, phases=None, on_started=None) -> int:
    """The generation rank's loop (module docstring). ``phases``: the entrypoint's
    ``PhaseBoard``, told what the rank does (``generation: sync`` / ``generation: gen`` of the
    batch count), so a failure line names where a generation rank was. ``on_started()``: called
    once the engine is built (``split_run.fit_split``)."""
    spec, uses_te, dtype, train = receive_command(split)
    se = build_split_engine(cfg, split, spec, train=train, dtype=dtype, uses_te=uses_te)
    rank, engine, members = split.rank, se.engine, se.members
    if cfg.rollout.multi_turn.enable:  # the agent loop runs here, where the engine is
        from hybridrl.data.build import build_tokenizer
        from hybridrl.rollout.multi_turn.wrap import loop_engine_of

        engine = loop_engine_of(cfg, build_tokenizer(cfg.model), engine)
    replica = se.plan.gen.coords[rank][2]
    n_replicas, pending, batches, verify, syncs = len(split.gen_replicas()), [], 0, True, 0
    held = {}  # request seed -> (rows, GenerationOutput): generated, not yet handed off
    is_src = rank == members[0]
    hand = split.handoff or split.bridge  # the batches' own communicator (parallel.split)
    device = split.device()
    if on_started is not None:
        on_started()
    while True:
        cmd = receive_command(split)
        if phases is not None:
            phases.record(batches + 1, f"generation: {cmd.op}")
        if cmd.op == "stop":
            break
        if cmd.op == "sync":  # the rows land in the engine (builtin: in place; SGLang: pushed)
            se.receive_weights(verify)
            verify, syncs = False, syncs + 1
            continue
        if cmd.op == "handoff":  # only a replica's first rank holds (and sends) its rows
            if is_src:
                rows, out = held[cmd.seed]
                pending += send_rows(hand, rows, out, cmd.parts, cmd.dp_of, device)
            if cmd.drop:
                held.pop(cmd.seed, None)
            continue
        pending = [w for w in pending if not w.is_completed()]  # sent: no longer held
        rows = replica_rows(len(cmd.prompts), n_replicas)[replica]
        out, t0 = None, time.perf_counter()
        if rows:
            seeds = tuple(request_seed(cmd.seed, i) for i in rows)
            out = engine.generate([cmd.prompts[i] for i in rows],
                                  dataclasses.replace(cmd.params, seed=cmd.seed, row_seeds=seeds))
        gen_s = time.perf_counter() - t0
        if is_src:
            held[cmd.seed] = (rows, out)
            pending += send_lengths(hand, split.train_ranks, out, gen_s, syncs, device)
        batches += 1
    for w in pending:
        w.wait()
    return batches
