"""Process groups of a split placement: training ranks and generation ranks apart.

Contract:
- ``build_split_groups(train, gen_world, gen_tp, timeout_s, gen_timeout_s=None)`` (collective:
  every rank of the
  default group, ``train.world + gen_world`` of them, same arguments): checks with one
  all_gather that every rank holds the same layout (and, on NCCL, the same ``NCCL_*``
  variables), then creates, in the same order on every rank, megatron's training groups over
  ranks ``0 .. T-1`` (``build_groups``' families, with gloo twins of dp / dp_cp / expt_dp on
  NCCL, the groups themselves on gloo), the
  training world ``0 .. T-1`` (a group of its own, never one of the families even when one spans
  the same ranks: it becomes the default group inside ``training_world``, and destroying a group
  that is the default group tears down every group), one gen-TP group per generation replica (ranks ``T + i``, a replica
  being ``gen_tp`` consecutive ranks) and its gloo twin, a gloo group over the generation ranks,
  the command group ``{0} + generation ranks``, the
  bridge (every rank: the weight sync) and the hand-off group (every rank again, a communicator
  of its own: the generated batches). Every group has the collective
  timeout ``timeout_s`` except the command group (``COMMAND_TIMEOUT_S``, a day: the generation
  ranks wait on it while the trainer trains), the hand-off group (the same day: every wait on
  it carries its own bound, and on NCCL the group's timeout is a watchdog that would cut a long
  generation, or a generation rank's sends pending over a long step, short) and the generation
  ranks' gloo groups
  (``gen_timeout_s``, default ``timeout_s``; give it ``rollout.timeout_s`` with SGLang: a
  replica's other ranks wait on its twin while its first rank generates). Returns a ``SplitGroups``:
  ``groups`` (the training rank's ``ParallelGroups``; None on a generation rank), ``bridge``,
  ``handoff``, ``command``, ``gen_tp`` (this generation rank's group, None at gen tp 1 or on a training rank),
  ``gen_tp_gloo`` (its gloo twin: object exchanges of an SGLang replica), ``gen_gloo`` (gloo over
  every generation rank, None on a training rank), ``train_world``, ``backend`` and the rank sets.
- Backends (``split_backends(backend)``): the default group's backend (gloo on CPU, NCCL on
  CUDA: ``init_distributed`` binds rank r to GPU ``LOCAL_RANK``) for the training families, the
  training world, the gen-TP groups and the bridge, whose NCCL communicators are created here,
  eagerly, bound to this rank's GPU: every tensor that crosses the bridge on NCCL must be a CUDA
  tensor. The command group and the gloo twins are gloo on either (Python objects; the command
  group's day-long wait must not be NCCL's). Any other backend is a ValueError. The weights
  (training -> generation) and the batches (generation -> training) travel on two groups: NCCL
  runs a group's point-to-point operations between two ranks in posting order on one stream and
  ignores tags, so a generated batch posted before a weight sync that the training rank receives
  only after it would block that sync's receives behind it on one communicator (a deadlock).
- Nodes (``replica_node_problem``): on NCCL, with ``LOCAL_WORLD_SIZE`` = L ranks per node,
  every generation replica must sit inside one node (its TP collectives and an SGLang Engine,
  which places TP rank k on GPU ``base_gpu_id + k``, span one host): gen tp <= L, and no replica
  may straddle a node boundary (ranks ``T + i .. T + i + gen_tp - 1``). Generation ranks may be
  whole nodes (T a multiple of L). A violation is one ValueError line before any group exists.
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
import os

import torch
import torch.distributed as dist

from hybridrl.parallel.groups import (
    DEFAULT_TIMEOUT_S,
    EXPERT_AXES,
    TRAIN_AXES,
    ParallelGroups,
    _check_same_everywhere,
    all_rank_sets,
    apply_nccl_env,
)
from hybridrl.parallel.layout import TrainLayout

COMMAND_TIMEOUT_S = 86400.0
BACKENDS = ("gloo", "nccl")


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
    gen_tp_gloo: dist.ProcessGroup | None = None
    gen_gloo: dist.ProcessGroup | None = None
    backend: str = "gloo"
    handoff: dist.ProcessGroup | None = None

    @property
    def is_gen(self) -> bool:
        return self.rank in self.gen_ranks

    def gen_replicas(self) -> list[list[int]]:
        """The generation replicas' ranks, gen TP order."""
        g, tp = self.gen_ranks, self.gen_tp_size
        return [list(g[i:i + tp]) for i in range(0, len(g), tp)]

    def device(self) -> torch.device:
        """Where tensors that cross the bridge live: this rank's GPU on NCCL, else the CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def split_backends(backend: str) -> dict[str, str]:
    """Backend of each kind of split group over a default group of ``backend`` (module doc)."""
    if backend not in BACKENDS:
        raise ValueError(f"parallel.placement=split runs on gloo (CPU) or nccl (CUDA) ranks; "
                         f"the default group's backend is {backend!r}")
    return {"train": backend, "train_world": backend, "gen_tp": backend, "bridge": backend,
            "handoff": backend, "command": "gloo", "gloo_twins": "gloo", "gen_gloo": "gloo"}


def replica_node_problem(train_world: int, gen_world: int, gen_tp: int,
                         local_world: int | None) -> str | None:
    """None when every generation replica sits inside one node of ``local_world`` consecutive
    ranks (None / 0: one node, nothing to check); else the first problem, one line."""
    if not local_world:
        return None
    if gen_tp > local_world:
        return (f"parallel.gen.tp={gen_tp} is more than the {local_world} GPUs of a node "
                f"(LOCAL_WORLD_SIZE): a generation replica runs on one node")
    for i in range(0, gen_world, gen_tp):
        first, last = train_world + i, train_world + i + gen_tp - 1
        if first // local_world != last // local_world:
            return (f"generation replica on ranks {first}..{last} spans two nodes of "
                    f"{local_world} GPUs (training world {train_world}); make the training "
                    f"world a multiple of parallel.gen.tp (e.g. whole generation nodes)")
    return None


def build_split_groups(train: TrainLayout, gen_world: int, gen_tp: int,
                       timeout_s: float = DEFAULT_TIMEOUT_S,
                       gen_timeout_s: float | None = None) -> SplitGroups:
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
    kinds = split_backends(backend)
    env = {"split": (gen_world, gen_tp)}
    device = None
    if backend == "nccl":
        problem = replica_node_problem(train.world, gen_world, gen_tp,
                                       int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None)
        if problem:
            raise ValueError(problem)
        env.update(apply_nccl_env())  # before the first communicator below (build_groups')
        device = torch.device("cuda", torch.cuda.current_device())
    _check_same_everywhere(train, None, env)
    timeout = datetime.timedelta(seconds=timeout_s)
    gen_timeout = datetime.timedelta(seconds=gen_timeout_s or timeout_s)
    cache: dict[tuple, dist.ProcessGroup] = {}

    def make(ranks, kind: str, wait=timeout) -> dist.ProcessGroup:
        pg_backend = kinds[kind]
        key = (pg_backend, wait, *ranks)
        if key not in cache:  # every rank reaches this line for the same keys in one order
            cache[key] = dist.new_group(list(ranks), timeout=wait, backend=pg_backend,
                                        device_id=device if pg_backend == "nccl" else None)
        return cache[key]

    groups, members = {}, {}
    for name, rank_sets in all_rank_sets(train, None).items():
        for ranks in rank_sets:
            pg = make(tuple(ranks), "train")
            if rank in ranks:
                groups[name], members[name] = pg, tuple(ranks)
    twins = {name: groups.get(name) for name in ("dp", "dp_cp", "expt_dp")}
    if backend != "gloo":  # megatron's gloo twins of the DP groups (as build_groups makes)
        for name in twins:
            for ranks in (train.expert_groups(EXPERT_AXES[name]) if name in EXPERT_AXES
                          else train.groups(TRAIN_AXES[name])):
                pg = make(tuple(ranks), "gloo_twins")
                twins[name] = pg if rank in ranks else twins[name]
    train_ranks = tuple(range(train.world))
    gen_ranks = tuple(range(train.world, world))
    train_world = dist.new_group(list(train_ranks), timeout=timeout,  # its own (module doc)
                                 backend=kinds["train_world"],
                                 device_id=device if backend == "nccl" else None)
    gen_tp_mine = gen_tp_gloo = None
    for i in range(0, gen_world, gen_tp):
        ranks = gen_ranks[i:i + gen_tp]
        pg = make(ranks, "gen_tp") if gen_tp > 1 else None
        twin = make(ranks, "gloo_twins", gen_timeout) if gen_tp > 1 else None
        if rank in ranks:
            gen_tp_mine, gen_tp_gloo = pg, twin
    gen_gloo = make(gen_ranks, "gen_gloo", gen_timeout)
    # the generation ranks wait on it between commands, i.e. for as long as a training step (or
    # the demo's SFT) takes: a day, not the collective timeout; a failed training rank ends the
    # job through torchrun, which stops them
    command = dist.new_group([0, *gen_ranks], backend=kinds["command"],
                             timeout=datetime.timedelta(seconds=COMMAND_TIMEOUT_S))
    bridge = make(tuple(range(world)), "bridge")
    # every wait on the hand-off carries its own bound (rollout.timeout_s on the training side);
    # the group's timeout is NCCL's watchdog, which would cut a long generation (or a
    # generation rank's pending sends over a long training step) short: a day, as the command's
    handoff = dist.new_group(list(range(world)),  # a communicator of its own
                             timeout=datetime.timedelta(seconds=COMMAND_TIMEOUT_S),
                             backend=kinds["handoff"],
                             device_id=device if backend == "nccl" else None)
    is_train = rank < train.world
    parallel = (ParallelGroups(train=train, gen=None, rank=rank, backend=backend, groups=groups,
                               members=members, gloo_dp=twins["dp"], gloo_dp_cp=twins["dp_cp"],
                               gloo_expt_dp=twins["expt_dp"])
                if is_train else None)
    return SplitGroups(train_ranks, gen_ranks, gen_tp, rank, parallel,
                       train_world if is_train else None, bridge,
                       command if rank == 0 or not is_train else None, gen_tp_mine,
                       gen_tp_gloo, None if is_train else gen_gloo, backend, handoff)


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
