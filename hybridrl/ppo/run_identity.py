"""Run identity: a checkpoint folder resumes only the run that wrote it.

Contract:
- ``run_id(cfg)`` is a 16-hex-digit hash of the resolved config (seed included) without the keys
  in ``NOT_IDENTITY`` (how long to run, where and how often to save/log, how to resume, timeouts,
  guards, the parallel layout: a checkpoint resumes at another layout): the same experiment
  continued with more steps or on other (tp, pp, dp) keeps its id, any other change (lr, data,
  model, seed, ...) makes another run. Only values that differ from the defaults are hashed: a
  knob added by a newer hybridrl (with its default) does not change the id of an older run.
- ``plan_run_dir(root, mode, resume_path, run, overwrite)`` (pure apart from reading ``root``)
  decides, on rank 0, what an existing ``checkpoint_dir`` means and returns a ``RunDirPlan``:
  the checkpoint to resume (or None), folders to move aside, a notice line, or the error line.
  ``auto`` resumes the newest complete ``global_step_N`` only when its run id (``meta.json``) is
  ``run``; another id is refused naming both. ``disable`` refuses a folder that already holds
  checkpoints or another run's ``run.json`` unless ``overwrite`` (they are then moved into
  ``previous_<k>/``, never deleted). ``path`` resumes ``resume_path`` (which must exist), also
  from another run id (a notice says so: an explicit choice).
- ``apply_run_dir(root, plan, run, seed)`` (rank 0 only) removes leftover ``.tmp_global_step_*``
  folders (never complete by construction), moves aside what the plan says and writes
  ``run.json``.
- ``StartupError`` (a ``ValueError``) marks problems found before the first step: the entrypoint
  reports them with exit status 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from hybridrl.ppo.checkpoint import latest_checkpoint

RUN_FILE = "run.json"
NOT_IDENTITY = {"trainer": ("resume", "resume_path", "total_steps", "total_epochs", "overwrite",
                            "save_freq", "test_freq", "val_before_train", "logger",
                            "checkpoint_dir", "collective_timeout_s", "nonfinite", "kl_guard",
                            "device", "max_ckpt_to_keep", "async_save"),
                "parallel": ("tp", "pp", "dp", "cp", "ep", "order", "gen")}


class StartupError(ValueError):
    """A problem found before the first step (bad input, not a training failure)."""


def _non_default(data: dict, default: dict) -> dict:
    """The entries of ``data`` that differ from ``default`` (recursively, by section)."""
    out = {}
    for key, value in data.items():
        base = default.get(key)
        if isinstance(value, dict) and isinstance(base, dict):
            sub = _non_default(value, base)
            if sub:
                out[key] = sub
        elif value != base:
            out[key] = value
    return out


def run_id(cfg) -> str:
    """Hash of the resolved config without ``NOT_IDENTITY`` (see module docstring). Only the
    values that differ from the defaults count, so a newer hybridrl that adds a knob (with a
    default) still resumes the runs of an older one."""
    data = dataclasses.asdict(cfg)
    for section, keys in NOT_IDENTITY.items():
        for key in keys:
            data[section].pop(key, None)
    data = _non_default(data, dataclasses.asdict(type(cfg)()))
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass
class RunDirPlan:
    resume: str | None = None
    move_aside: list[str] = dataclasses.field(default_factory=list)
    notice: str | None = None
    error: str | None = None


def _saved_id(folder: Path) -> str | None:
    try:
        return json.loads((folder / "meta.json").read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def _recorded_id(root: Path) -> str | None:
    try:
        return json.loads((root / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def _previous(root: Path) -> list[str]:
    """Names of what a fresh run would overwrite: checkpoints, metrics, run.json."""
    if not root.is_dir():
        return []
    return sorted(c.name for c in root.iterdir() if c.name.startswith("global_step_")
                  or c.name in ("metrics.jsonl", RUN_FILE))


def plan_run_dir(root: str | Path, mode: str, resume_path: str, run: str,
                 overwrite: bool) -> RunDirPlan:
    root = Path(root)
    where = f"trainer.checkpoint_dir {str(root)!r}"
    if mode == "path":
        path = Path(resume_path)
        if not path.is_dir():
            return RunDirPlan(error=f"trainer.resume_path {resume_path!r} does not exist")
        other = _saved_id(path)
        note = (None if other == run else f"resuming {resume_path} of run {other} "
                f"with a different config (run {run}): trainer.resume=path allows it")
        return RunDirPlan(resume=str(path), notice=note)
    latest = latest_checkpoint(root) if mode == "auto" else None
    recorded = _recorded_id(root)
    if latest is not None:
        other = _saved_id(latest)
        if other == run:
            return RunDirPlan(resume=str(latest))
        return RunDirPlan(error=(
            f"trainer.resume=auto: {where} holds {latest.name} of run {other} but this config "
            f"is run {run} (seed or settings differ); use another checkpoint_dir, "
            "trainer.resume=disable trainer.overwrite=true, or trainer.resume=path"))
    previous = _previous(root)
    has_ckpt = latest_checkpoint(root) is not None
    foreign = recorded is not None and recorded != run
    if not (has_ckpt or foreign):
        return RunDirPlan()
    if not overwrite:
        return RunDirPlan(error=(
            f"trainer.resume={mode}: {where} already holds run {recorded}'s "
            f"{', '.join(previous[:3])}{'...' if len(previous) > 3 else ''}; this is run "
            f"{run}: set trainer.overwrite=true to move them aside, or use another folder"))
    return RunDirPlan(move_aside=previous,
                      notice=f"moved run {recorded}'s {len(previous)} entries of {root} aside")


def apply_run_dir(root: str | Path, plan: RunDirPlan, run: str, seed: int) -> None:
    """Rank 0: clean temporary folders, move aside, record ``run.json`` (see docstring)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for child in root.iterdir():
        if child.name.startswith(".tmp_global_step_") and child.is_dir():
            shutil.rmtree(child)
    if plan.move_aside:
        k = 0
        while (root / f"previous_{k}").exists():
            k += 1
        dest = root / f"previous_{k}"
        dest.mkdir()
        for name in plan.move_aside:
            os.replace(root / name, dest / name)
        if plan.notice:
            plan.notice = plan.notice.replace(" aside", f" aside into {dest}")
    tmp = root / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps({"run_id": run, "seed": seed}) + "\n")
    os.replace(tmp, root / RUN_FILE)
