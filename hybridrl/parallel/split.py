"""Process groups of a split placement: training ranks and generation ranks apart.

Contract:
- ``build_split_groups(train, gen_world, gen_tp, timeout_s)`` (collective: every rank of the
  default group, ``train.world + gen_world`` of them, same arguments): checks with one
  all_gather that every rank holds the same layout, then creates, in the same order on every
  rank, megatron's training groups over ranks ``0 .. T-1`` (``build_groups``' families), the
  training world ``0 .. T-1`` (a group of its own, never one of the families even when one spans
  the same ranks: it becomes the default group inside ``training_world``, and destroying a group
  that is the default group tears down every group), one gen-TP group per generation replica (ranks ``T + i``, a replica
  being ``gen_tp`` consecutive ranks), the command group ``{0} + generation ranks`` and the
  bridge (every rank: the weight sync and the batch hand-off). Every group has the collective
  timeout ``timeout_s`` except the command group (``COMMAND_TIMEOUT_S``, a day: the generation
  ranks wait on it while the trainer trains). Returns a ``SplitGroups``:
  ``groups`` (the training rank's ``ParallelGroups``; None on a generation rank), ``bridge``,
  ``command``, ``gen_tp`` (this generation rank's group, None at gen tp 1 or on a training rank),
  ``train_world`` and the rank sets.
- ``training_world(split)`` (context manager, training ranks): the training-world group is the
  default group inside it, so every collective the trainer makes on the default group
  (checkpoints, guards, metrics, validation, start-up) spans the training ranks only and can
  never meet the generation ranks' loop: the two sets may run at the same time without a
  deadlock. Global rank numbers are unchanged (training ranks are the first T). The default
  group is restored on exit (the entrypoint's last barrier spans every rank again). No process
  group may be created inside it (checked on exit: torch's group count must not move; a
  RuntimeError otherwise): torch names a new group by a per-process count that only the
  training ranks would advance, so the next group made on every rank would differ in name
  between the two sets. Generation ranks never call the default group
  during a run (their loop uses ``command``, ``bridge`` and ``gen_tp`` only).
  ``default_group(group, new_groups=False)``: the same for any group of ranks ``0 .. n-1``
  (tests run a smaller job inside a larger launch with it, ``new_groups=True``: the job builds
  its groups inside, and the test aligns the group count of every rank before the next job).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime

import torch.distributed as dist

from hybridrl.parallel.groups import (
    DEFAULT_TIMEOUT_S,
    ParallelGroups,
    _check_same_everywhere,
    all_rank_sets,
)
from hybridrl.parallel.layout import TrainLayout

COMMAND_TIMEOUT_S = 86400.0


@dataclasses.dataclass(frozen=True)
class SplitGroups:
    """One rank's view of a split placement's groups (see module docstring)."""

    train_ranks: tuple[int, ...]
    gen_ranks: tuple[int, ...]
    gen_tp_size: int
    rank: int
    groups: ParallelGroups | None
    train_world: dist.ProcessGroup | None
    bridge: dist.ProcessGroup
    command: dist.ProcessGroup | None
    gen_tp: dist.ProcessGroup | None

    @property
    def is_gen(self) -> bool:
        return self.rank in self.gen_ranks

    def gen_replicas(self) -> list[list[int]]:
        """The generation replicas' ranks, gen TP order."""
        g, tp = self.gen_ranks, self.gen_tp_size
        return [list(g[i:i + tp]) for i in range(0, len(g), tp)]


def build_split_groups(train: TrainLayout, gen_world: int, gen_tp: int,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> SplitGroups:
    """Every group of a split placement, created on every rank in one order (module doc)."""
    if not dist.is_initialized():
        raise RuntimeError("build_split_groups needs torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if train.world + gen_world != world:
        raise ValueError(f"split placement: {train.world} training + {gen_world} generation "
                         f"ranks, but torch.distributed world size is {world}")
    if gen_world % gen_tp:
        raise ValueError(f"parallel.gen.tp={gen_tp} must divide parallel.gen.world={gen_world}")
    backend = dist.get_backend()
    if backend != "gloo":
        raise ValueError(f"parallel.placement=split runs on gloo ranks only for now, got {backend}")
    _check_same_everywhere(train, None, {"split": (gen_world, gen_tp)})
    timeout = datetime.timedelta(seconds=timeout_s)
    cache: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def make(ranks) -> dist.ProcessGroup:
        key = tuple(ranks)
        if key not in cache:  # every rank reaches this line for the same keys in one order
            cache[key] = dist.new_group(list(key), timeout=timeout)
        return cache[key]

    groups, members = {}, {}
    for name, rank_sets in all_rank_sets(train, None).items():
        for ranks in rank_sets:
            pg = make(ranks)
            if rank in ranks:
                groups[name], members[name] = pg, tuple(ranks)
    train_ranks = tuple(range(train.world))
    gen_ranks = tuple(range(train.world, world))
    train_world = dist.new_group(list(train_ranks), timeout=timeout)  # its own (module doc)
    gen_tp_mine = None
    for i in range(0, gen_world, gen_tp):
        ranks = gen_ranks[i:i + gen_tp]
        pg = make(ranks) if gen_tp > 1 else None
        gen_tp_mine = pg if rank in ranks else gen_tp_mine
    # the generation ranks wait on it between commands, i.e. for as long as a training step (or
    # the demo's SFT) takes: a day, not the collective timeout; a failed training rank ends the
    # job through torchrun, which stops them
    command = dist.new_group([0, *gen_ranks], timeout=datetime.timedelta(seconds=COMMAND_TIMEOUT_S))
    bridge = make(tuple(range(world)))
    is_train = rank < train.world
    parallel = (ParallelGroups(train=train, gen=None, rank=rank, backend=backend, groups=groups,
                               members=members, gloo_dp=groups["dp"], gloo_dp_cp=groups["dp_cp"])
                if is_train else None)
    return SplitGroups(train_ranks, gen_ranks, gen_tp, rank, parallel,
                       train_world if is_train else None, bridge,
                       command if rank == 0 or not is_train else None, gen_tp_mine)


def training_world(split: SplitGroups):
    """The training world as the default group, on a training rank (module docstring)."""
    return default_group(split.train_world)


@contextlib.contextmanager
def default_group(group: dist.ProcessGroup, new_groups: bool = False):
    """``group`` (whose members are ranks ``0 .. n-1`` of the current default group, so rank
    numbers stay the same) as the default group inside the block; restored on exit. Unless
    ``new_groups``, creating a process group inside the block is a RuntimeError on exit."""
    c10d = dist.distributed_c10d
    saved, count = c10d._world.default_pg, c10d._world.group_count
    if c10d._world.pg_group_ranks[group] != {r: r for r in range(group.size())}:
        raise ValueError("default_group: the group must hold ranks 0 .. n-1 of the world")
    c10d._world.default_pg = group
    try:
        yield
    finally:
        c10d._world.default_pg = saved
    made = c10d._world.group_count - count
    if made and not new_groups:
        raise RuntimeError(f"{made} process group(s) created inside training_world/default_group:"
                           " only the training ranks would count them, so group names diverge "
                           "from the generation ranks'; create groups before the swap "
                           "(hybridrl/parallel/split.py)")
