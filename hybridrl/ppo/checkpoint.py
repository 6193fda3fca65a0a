"""Atomic, resumable PPO checkpoints: ``<checkpoint_dir>/global_step_<N>/``.

Contract:
- ``save_checkpoint(root, step, rank_state, trainer_state, meta, shared=None)`` is collective
  (every rank of the default group calls it; ``root`` must be on storage every rank sees). Every
  rank writes ``rank_<r>.pt`` (``rank_state``: what only it holds, e.g. RNG states) into
  ``.tmp_global_step_<N>/``; ``shared = (name, state)`` is written as ``<name>`` by the ranks
  whose ``state`` is not None: the trainer names one file per (tp, pp) model shard and only DP
  rank 0 passes it, since its DP replicas hold the same parameters (a dp = 32 run writes each
  shard once, not 32 times); the optimizer state, sharded over DP, goes into each rank's file. Rank 0 adds ``trainer_state.pt`` (step, KL
  controller, data loader position, ...) and ``meta.json``; after a barrier rank 0 writes the
  ``COMPLETE`` marker and
  renames the folder to ``global_step_<N>`` (an existing one is replaced). Each file is written
  to a temporary name and ``os.replace``d, so a crash at any point leaves either no new
  checkpoint or a complete one, never a half-written ``global_step_<N>``.
- ``latest_checkpoint(root)`` is the complete ``global_step_<N>`` with the largest N (None when
  there is none); incomplete or temporary folders are ignored.
- ``capture_state(models, kl_ctrl)`` / ``restore_state(models, state, kl_ctrl)``: host copies
  of this rank's optimizer states (1/dp shards with the distributed optimizer; they determine the
  parameters) and the KL controller, and putting them back (the KL guard's rollback and the
  per-rank part of checkpoints); ``capture_params(models)`` copies the parameters by module name
  (the shared model file). ``models`` = [(ShardedModel, ModelOptimizer)].
- ``load_checkpoint(path, rank, meta, shared_name=None)`` returns ``(state, trainer_state)``,
  ``state`` = this rank's ``rank_state`` merged over the shared file ``shared_name`` (when given);
  a checkpoint written by a different world size or layout (``meta`` differs) raises
  ``ValueError`` naming the fields, as does a missing folder or file, and a file that cannot be
  read (truncated, corrupt: one line naming the file).
- ``save_checkpoint`` first agrees over every rank that no floating-point value in any rank's
  state is NaN/inf; otherwise every rank raises ``RuntimeError`` naming the ranks, and nothing is
  written (no folder, no ``COMPLETE``).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(root: str | Path, step: int, rank_state: dict, trainer_state: dict,
                    meta: dict, shared: tuple[str, dict | None] | None = None) -> Path:
    """Write this rank's part of checkpoint ``step`` (collective; see module docstring)."""
    root = Path(root)
    rank = dist.get_rank() if dist.is_initialized() else 0
    _refuse_nonfinite(step, rank, rank_state, shared[1] if shared is not None else None)
    final, tmp = root / f"global_step_{step}", root / f".tmp_global_step_{step}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    _atomic_save(rank_state, tmp / f"rank_{rank:05d}.pt")
    if shared is not None and shared[1] is not None:
        _atomic_save(shared[1], tmp / shared[0])
    if rank == 0:
        _atomic_save(trainer_state, tmp / "trainer_state.pt")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    _barrier()
    if rank == 0:
        (tmp / COMPLETE).write_text(f"step {step}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint folder with the highest step under ``root`` (or None)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / COMPLETE).is_file():
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def load_checkpoint(path: str | Path, rank: int, meta: dict,
                    shared_name: str | None = None) -> tuple[dict, dict]:
    """(this rank's state over its shared file's, the trainer state) of checkpoint ``path``."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} does not exist (or is not a folder)")
    if not (path / COMPLETE).is_file():
        raise ValueError(f"checkpoint {str(path)!r} is not a complete checkpoint "
                         f"(no {COMPLETE} marker)")
    saved = _read(path / "meta.json", lambda f: json.loads(f.read_text()))
    diff = {k: (saved.get(k), v) for k, v in meta.items() if saved.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"checkpoint {str(path)!r} was written by a different run layout "
                         f"({detail}); resume with the same world size and parallel config")
    rank_file = path / f"rank_{rank:05d}.pt"
    if not rank_file.is_file():
        raise ValueError(f"checkpoint {str(path)!r} has no {rank_file.name}")
    state = {}
    if shared_name is not None:
        if not (path / shared_name).is_file():
            raise ValueError(f"checkpoint {str(path)!r} has no {shared_name}")
        state = _read(path / shared_name, _torch_load)
    state.update(_read(rank_file, _torch_load))
    trainer_state = _read(path / "trainer_state.pt", _torch_load)
    return state, trainer_state


def _torch_load(file: Path):
    return torch.load(file, map_location="cpu", weights_only=False)


def _read(file: Path, load):
    """``load(file)``; any failure (truncated, corrupt, missing) is one ValueError naming it."""
    try:
        return load(file)
    except Exception as err:  # EOFError, UnpicklingError, JSONDecodeError, OSError, ...
        detail = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(f"checkpoint file {str(file)!r} cannot be read ({type(err).__name__}"
                         f"{': ' + detail if detail else ''}); it is truncated or corrupt: "
                         "resume from an older global_step_* (trainer.resume=path)") from None


def nonfinite_paths(obj, prefix: str = "") -> list[str]:
    """Paths (``a.b[2]``) of the floating-point tensors/floats in ``obj`` holding NaN or inf."""
    if isinstance(obj, torch.Tensor):
        return [] if not obj.is_floating_point() or bool(torch.isfinite(obj).all()) else [prefix]
    if isinstance(obj, float):
        return [] if obj == obj and abs(obj) != float("inf") else [prefix]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in nonfinite_paths(v, f"{prefix}.{k}")]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in nonfinite_paths(v, f"{prefix}[{i}]")]
    return []


def _refuse_nonfinite(step: int, rank: int, rank_state: dict, shared: dict | None) -> None:
    """Collective: raise RuntimeError on every rank (before anything is written) when any rank's
    state holds a non-finite value; the message names the ranks and the first bad entry."""
    bad = nonfinite_paths({"rank": rank_state, "shared": shared or {}})
    flags = torch.zeros(dist.get_world_size() if dist.is_initialized() else 1)
    flags[rank] = 1.0 if bad else 0.0
    if dist.is_initialized() and dist.get_world_size() > 1:
        on_nccl = dist.get_backend() == "nccl"  # NCCL takes no CPU tensors
        flags = flags.cuda() if on_nccl else flags
        dist.all_reduce(flags)
    ranks = [r for r, f in enumerate(flags.cpu().tolist()) if f]
    if ranks:
        where = f" (rank {rank}: {bad[0].lstrip('.')})" if bad else ""
        raise RuntimeError(f"checkpoint global_step_{step} not written: non-finite parameters "
                           f"or optimizer state on rank(s) {ranks}{where}")


def _cpu_copy(obj):
    """A deep copy of ``obj`` with every tensor copied to host memory (restores copy_ back)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def capture_params(models) -> list[dict]:
    """Host copies of each trainable model's parameters, by module name (this rank's shard)."""
    return [{n: _cpu_copy(p) for n, p in m.module.named_parameters()} for m, _ in models]


def capture_state(models, kl_ctrl) -> dict:
    """Host copies of each optimizer's state on this rank (its DP shard with the distributed
    optimizer) and of the KL controller: enough to restore the models too, since an optimizer's
    fp32 main parameters determine the model's parameters. On GPU it costs no device memory."""
    return {"optim": [_cpu_copy(o.state_dict()) for _, o in models],
            "kl_ctrl": dict(kl_ctrl.state_dict())}


@torch.no_grad()
def restore_state(models, state: dict, kl_ctrl) -> None:
    """Put back what ``capture_state`` took (and ``capture_params``' parameters, under
    ``"params"``, when given): parameters are copied in place, then each optimizer's state is
    loaded, which rebuilds the parameters from its main parameters."""
    if len(state["optim"]) != len(models):
        raise ValueError(f"saved state holds {len(state['optim'])} models, this run has "
                         f"{len(models)} (a critic in one and not the other?)")
    for i, ((model, opt), optim) in enumerate(zip(models, state["optim"])):
        params = state["params"][i] if "params" in state else None
        for name, p in model.module.named_parameters() if params is not None else ():
            if name not in params:
                raise ValueError(f"saved state lacks parameter {name!r}")
            p.copy_(params[name])
        opt.load_state_dict(copy.deepcopy(optim))
    kl_ctrl.load_state_dict(state["kl_ctrl"])
