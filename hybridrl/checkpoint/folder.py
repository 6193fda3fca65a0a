"""Checkpoint folders on disk: ``<checkpoint_dir>/global_step_<N>/``, atomic and checked.

Contract (the files; what goes in them is ``hybridrl.checkpoint.checkpointer``):
- A checkpoint is written into ``.tmp_global_step_<N>/`` (``begin_folder``, collective: rank 0
  creates it, then a barrier). Every rank writes its own ``rank_<r>.pt`` in parallel
  (``write_file``: ``torch.save`` to a temporary name, ``fsync``, ``os.replace``; returns its
  size and CRC-32; a write that fails on a full disk raises ``OSError(ENOSPC)`` saying so). ``finish_folder`` (rank 0 only, after every rank's file is written) writes
  ``index.json`` (what each file holds, with its size and CRC-32), ``meta.json``,
  ``trainer_state.pt``, then the ``COMPLETE`` marker, fsyncs the folder and renames it to
  ``global_step_<N>`` (an existing one is replaced). A crash at any point leaves either no new
  checkpoint or a complete one, never a half-written ``global_step_<N>``.
- ``complete_checkpoints(root)``: the complete ``global_step_<N>`` folders, newest first;
  ``latest_checkpoint(root)`` the first (None when there is none). Incomplete and temporary
  folders are ignored. ``prune(root, keep)`` deletes all but the ``keep`` newest complete ones
  (``keep`` <= 0: none deleted).
- ``read_json(path, name)`` / ``read_file(path, name, info=None)``: a file of a checkpoint;
  with ``info`` (its ``index.json`` entry) the size and CRC-32 are checked first and the tensors
  are memory-mapped. Any failure (missing, truncated, corrupt) is one ``ValueError`` naming the
  file.
- ``capture_state(models, kl_ctrl)`` / ``restore_state(models, state, kl_ctrl)``: host copies
  of this rank's optimizer states (1/dp shards with the distributed optimizer; they determine the
  parameters) and the KL controller, and putting them back (the KL guard's per-step rollback).
  ``models`` = [(ShardedModel, ModelOptimizer)].
- ``refuse_nonfinite(step, rank, state)`` (collective) raises ``RuntimeError`` on every rank,
  before anything is written, when any rank's state holds NaN/inf, naming the ranks.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"
DISK_FULL_BYTES = 1 << 20  # a failed write with less free than this: the disk is full
INDEX, META, TRAINER_STATE = "index.json", "meta.json", "trainer_state.pt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_CHUNK = 1 << 24


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_file(obj, path: Path) -> dict:
    """``torch.save`` + fsync + rename; returns ``{"bytes", "crc32"}`` of the file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except Exception as err:  # torch's "enforce fail at inline_container.cc" hides a full disk
        free = shutil.disk_usage(path.parent).free
        if getattr(err, "errno", None) == errno.ENOSPC or free < DISK_FULL_BYTES:
            raise OSError(errno.ENOSPC, f"no space left on the disk of {path.parent} "
                                        f"({free / 2**20:.1f} MiB free)") from None
        raise
    os.replace(tmp, path)
    return {"bytes": path.stat().st_size, "crc32": crc32_of(path)}


def step_folder(root: str | Path, step: int, tmp: bool = False) -> Path:
    return Path(root) / (f".tmp_global_step_{step}" if tmp else f"global_step_{step}")


def begin_folder(root: str | Path, step: int) -> Path:
    """Collective: rank 0 creates an empty ``.tmp_global_step_<step>``; every rank gets it."""
    tmp = step_folder(root, step, tmp=True)
    if not dist.is_initialized() or dist.get_rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    return tmp


def finish_folder(root: str | Path, step: int, index: dict, meta: dict,
                  trainer_state: dict) -> Path:
    """Rank 0, once every rank's file is on disk: index, meta, trainer state, COMPLETE, rename."""
    tmp, final = step_folder(root, step, tmp=True), step_folder(root, step)
    index = {**index, "files": {**index["files"],
                                TRAINER_STATE: write_file(trainer_state, tmp / TRAINER_STATE)}}
    for name, data in ((INDEX, index), (META, meta)):
        with open(tmp / name, "w") as f:
            f.write(json.dumps(data, indent=1))
            f.flush()
            os.fsync(f.fileno())
    (tmp / COMPLETE).write_text(f"step {step}\n")
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoint folders under ``root``, newest (highest step) first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / COMPLETE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found, reverse=True)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint folder with the highest step under ``root`` (or None)."""
    found = complete_checkpoints(root)
    return found[0] if found else None


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints; returns the deleted folders."""
    old = complete_checkpoints(root)[keep:] if keep > 0 else []
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def read_json(path: Path, name: str) -> dict:
    return _read(path / name, lambda f: json.loads(f.read_text()))


def read_file(path: Path, name: str, info: dict | None = None):
    """A ``.pt`` file of checkpoint ``path`` (checked against its ``index.json`` entry)."""
    file = path / name

    def load(f: Path):
        if info is not None:
            size = f.stat().st_size
            if size != info["bytes"]:
                raise OSError(f"{size} bytes, index.json says {info['bytes']}")
            if crc32_of(f) != info["crc32"]:
                raise OSError("CRC-32 differs from index.json")
        return torch.load(f, map_location="cpu", weights_only=True, mmap=info is not None)

    return _read(file, load)


def _read(file: Path, load):
    """``load(file)``; any failure (truncated, corrupt, missing) is one ValueError naming it."""
    try:
        return load(file)
    except Exception as err:  # EOFError, UnpicklingError, JSONDecodeError, OSError, ...
        detail = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(f"checkpoint file {str(file)!r} cannot be read ({type(err).__name__}"
                         f"{': ' + detail if detail else ''}); it is missing, truncated or "
                         "corrupt") from None


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


def refuse_nonfinite(step: int, rank: int, state: dict) -> None:
    """Collective: raise RuntimeError on every rank (before anything is written) when any rank's
    state holds a non-finite value; the message names the ranks and the first bad entry."""
    bad = nonfinite_paths(state)
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


def capture_state(models, kl_ctrl) -> dict:
    """Host copies of each optimizer's state on this rank (its DP shard with the distributed
    optimizer) and of the KL controller: enough to restore the models too, since an optimizer's
    fp32 main parameters determine the model's parameters. On GPU it costs no device memory."""
    return {"optim": [_cpu_copy(o.state_dict()) for _, o in models],
            "kl_ctrl": dict(kl_ctrl.state_dict())}


@torch.no_grad()
def restore_state(models, state: dict, kl_ctrl) -> None:
    """Put back what ``capture_state`` took: each optimizer's state is loaded, which rebuilds
    the parameters from its main parameters."""
    if len(state["optim"]) != len(models):
        raise ValueError(f"saved state holds {len(state['optim'])} models, this run has "
                         f"{len(models)} (a critic in one and not the other?)")
    for (_, opt), optim in zip(models, state["optim"]):
        opt.load_state_dict(copy.deepcopy(optim))
    kl_ctrl.load_state_dict(state["kl_ctrl"])
