"""Real torch.distributed process groups for one training layout and its generation layout.

Contract:
- ``build_groups(train, gen)`` must be called on every rank of an initialized default process group
  with the same arguments. It validates the layouts against the world BEFORE any collective, then
  checks with one all_gather that every rank holds the same layout (a mismatch raises on every
  rank, never hangs), then creates each distinct rank set once, in the same order on all ranks
  (gloo on CPU, NCCL on CUDA, finite timeout). NCCL groups are created eagerly, bound to this
  rank's current CUDA device (``device_id``), so every communicator exists right here, under the
  NCCL environment set below, not at its first collective (which may come after an SGLang
  engine started and changed the environment of some ranks).
- NCCL environment: ``NCCL_ENV`` (``NCCL_CUMEM_ENABLE=0``, ``NCCL_NVLS_ENABLE=0``, the values
  SGLang's engine runs its own communicators with) is set on every rank before any NCCL
  communicator exists (``apply_nccl_env``, called by ``init_distributed`` before
  ``init_process_group`` and by ``build_groups``; a value the launcher already set is kept).
  ``build_groups`` checks that every rank sees the same ``NCCL_*`` variables (ValueError on
  every rank otherwise). Only the nccl backend touches any of this.
- The result, ``ParallelGroups``, is frozen and passed explicitly; there are no module globals.
  Layers should take the narrowest member they need (``groups.tp``), not the whole object.
- Train axes are named as megatron-core's ProcessGroupCollection names them (tp, pp, dp, cp, mp,
  tp_cp, dp_cp, tp_dp_cp, embd, pos_embd, ep, expt_tp, tp_ep, tp_ep_pp, expt_dp); the expert
  families (ep, expt_tp, tp_ep, tp_ep_pp, expt_dp) come from the layout's expert generator
  (``TrainLayout.expert_groups``: etp x ep x edp x pp), the others from the dense one; the
  generation
  layout adds gen_tp, gen_pp, micro_dp and gen_dp (all ranks holding the same generation shard).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

from hybridrl.parallel.layout import GenLayout, TrainLayout

DEFAULT_TIMEOUT_S = 600.0
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def apply_nccl_env() -> dict[str, str]:
    """Set ``NCCL_ENV`` where the launcher did not; returns every ``NCCL_*`` variable now set."""
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    return nccl_env()


def nccl_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}

# name -> axes of TrainLayout.groups() (the aliases below reuse identical rank sets)
TRAIN_AXES = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "cp": "cp",
    "mp": "tp-pp",
    "tp_cp": "tp-cp",
    "dp_cp": "cp-dp",
    "tp_dp": "tp-dp",
    "tp_dp_cp": "tp-cp-dp",
    # megatron's distributed-optimizer instance (one instance: every training rank); its grad
    # norm and num-zeros are reduced over it
    "intra_dist_opt": "tp-cp-ep-dp-pp",
}
# name -> axes of TrainLayout.expert_groups() (megatron's expert RankGenerator: tp there is etp)
EXPERT_AXES = {
    "ep": "ep",
    "expt_tp": "tp",
    "tp_ep": "tp-ep",
    "tp_ep_pp": "tp-ep-pp",
    "expt_dp": "dp",
}


def embedding_groups(train: TrainLayout) -> list[list[int]]:
    """First and last stage of each pipeline (they hold the tied word embeddings)."""
    return [sorted({g[0], g[-1]}) for g in train.groups("pp")]


def position_embedding_groups(train: TrainLayout) -> list[list[int]]:
    return [[g[0]] for g in train.groups("pp")]


def all_rank_sets(train: TrainLayout, gen: GenLayout | None) -> dict[str, list[list[int]]]:
    """Every named group family of the two layouts, as lists of rank lists (pure)."""
    sets = {name: train.groups(axes) for name, axes in TRAIN_AXES.items()}
    sets.update({name: train.expert_groups(axes) for name, axes in EXPERT_AXES.items()})
    sets["embd"] = embedding_groups(train)
    sets["pos_embd"] = position_embedding_groups(train)
    if gen is not None:
        sets["gen_tp"] = gen.tp_groups()
        sets["gen_pp"] = gen.pp_groups()
        sets["micro_dp"] = gen.micro_dp_groups()
        sets["gen_dp"] = gen.dp_groups()
    return sets


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """This rank's process group (and member ranks) for every axis of both layouts."""

    train: TrainLayout
    gen: GenLayout | None
    rank: int
    backend: str
    groups: dict[str, dist.ProcessGroup]
    members: dict[str, tuple[int, ...]]
    gloo_dp: dist.ProcessGroup | None = None  # gloo twin of dp (megatron's optimizer checkpoints)
    gloo_dp_cp: dist.ProcessGroup | None = None
    gloo_expt_dp: dist.ProcessGroup | None = None  # gloo twin of expt_dp

    def __getattr__(self, name: str) -> dist.ProcessGroup:
        groups = self.__dict__.get("groups", {})
        if name in groups:
            return groups[name]
        raise AttributeError(f"ParallelGroups has no group {name!r}; have {sorted(groups)}")

    def size(self, name: str) -> int:
        return len(self.members[name])

    def index(self, name: str) -> int:
        """This rank's position inside its ``name`` group."""
        return self.members[name].index(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.index("tp")

    @property
    def tp_size(self) -> int:
        return self.train.tp

    @property
    def pp_rank(self) -> int:
        return self.index("pp")

    @property
    def pp_size(self) -> int:
        return self.train.pp

    @property
    def dp_rank(self) -> int:
        return self.index("dp")

    @property
    def dp_size(self) -> int:
        return self.train.dp

    @property
    def ep_rank(self) -> int:
        return self.index("ep")

    @property
    def ep_size(self) -> int:
        return self.train.ep

    @property
    def etp_rank(self) -> int:
        return self.index("expt_tp")

    @property
    def etp_size(self) -> int:
        return self.train.etp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _check_world(train: TrainLayout, gen: GenLayout | None) -> None:
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs torch.distributed.init_process_group first")
    world = dist.get_world_size()
    if train.world != world:
        raise ValueError(f"layout world={train.world} but torch.distributed world size is {world}")


def _check_same_everywhere(train: TrainLayout, gen: GenLayout | None, env: dict) -> None:
    """One all_gather_object: every rank must have been given the same, consistent layouts
    and NCCL environment (a local inconsistency travels with the layout, so all ranks raise
    together)."""
    problem = None
    if gen is not None and gen.train != train:
        problem = "gen layout was derived from a different training layout"
    mine = (dataclasses.astuple(train), None if gen is None else (gen.tp, gen.pp, gen.grouping),
            problem, env)
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    errors = [(r, s[2]) for r, s in enumerate(seen) if s[2]]
    if errors:
        raise ValueError(f"rank {errors[0][0]}: {errors[0][1]}")
    bad = [r for r, other in enumerate(seen) if other[:2] != seen[0][:2]]
    if bad:
        raise ValueError(f"ranks disagree on the layout: rank 0 has {seen[0][:2]}, rank "
                         f"{bad[0]} has {seen[bad[0]][:2]}")
    bad = [r for r, other in enumerate(seen) if other[3] != seen[0][3]]
    if bad:
        raise ValueError(f"ranks see different NCCL variables: rank 0 {seen[0][3]}, rank "
                         f"{bad[0]} {seen[bad[0]][3]}; set them alike on every rank")


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialize the default group from torchrun's env (nccl on CUDA, else gloo); idempotent."""
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device_id = None
    if backend == "nccl":
        apply_nccl_env()  # before the first communicator (created right here: device bound)
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device_id)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device_id)


def build_groups(
    train: TrainLayout,
    gen: GenLayout | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ParallelGroups:
    """Create every group of ``train`` (and ``gen``) on all ranks; returns this rank's view."""
    _check_world(train, gen)
    backend = backend or dist.get_backend()
    env = apply_nccl_env() if backend == "nccl" else {}
    _check_same_everywhere(train, gen, env)
    timeout = datetime.timedelta(seconds=timeout_s)
    rank = dist.get_rank()
    cache: dict[tuple[int, ...], dist.ProcessGroup] = {}
    # NCCL communicators are created now (eagerly, device bound), under the environment above
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None

    def make(ranks: Iterable[int], pg_backend: str) -> dist.ProcessGroup:
        key = (pg_backend, *ranks)
        if key not in cache:  # every rank reaches this line for the same keys in the same order
            cache[key] = dist.new_group(list(ranks), timeout=timeout, backend=pg_backend,
                                        device_id=device if pg_backend == "nccl" else None)
        return cache[key]

    groups, members = {}, {}
    for name, rank_sets in all_rank_sets(train, gen).items():
        for ranks in rank_sets:
            pg = make(tuple(ranks), backend)
            if rank in ranks:
                groups[name], members[name] = pg, tuple(ranks)
    # megatron keeps gloo twins of the DP groups for CPU-side collectives (on gloo: themselves)
    gloo = {name: groups[name] for name in ("dp", "dp_cp", "expt_dp")}
    if backend != "gloo":
        for name in gloo:
            rank_sets = (train.expert_groups(EXPERT_AXES[name]) if name in EXPERT_AXES
                         else train.groups(TRAIN_AXES[name]))
            for ranks in rank_sets:
                pg = make(tuple(ranks), "gloo")
                gloo[name] = pg if rank in ranks else gloo[name]
    gloo_dp, gloo_dp_cp = gloo["dp"], gloo["dp_cp"]
    return ParallelGroups(
        train=train,
        gen=gen,
        rank=rank,
        backend=backend,
        groups=groups,
        members=members,
        gloo_dp=gloo_dp,
        gloo_dp_cp=gloo_dp_cp,
        gloo_expt_dp=gloo["expt_dp"],
    )
