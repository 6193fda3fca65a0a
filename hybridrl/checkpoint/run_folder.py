"""The run folder ``<trainer.output_dir>/<trainer.experiment_name>/``: what an existing one means.

Layout (rank 0 writes everything but the checkpoint shards)::

    run.json                     run id and seed of the run that owns the folder
    config.yaml                  the resolved config of the latest start
    config-<time>.yaml           an earlier start's config, when it differs
    metrics.jsonl                one line per step, steps 1..N, appended across resumes
    generations.jsonl            validation samples, one line each (with "step")
    metrics.redone.jsonl, generations.redone.jsonl
                                 lines of steps after the checkpoint a resume started from
    metrics.torn.txt             a half-written last line found at a resume (kept, named)
    plot.png                     ``hybridrl plot`` / the demo
    checkpoints/global_step_N/   unless ``trainer.checkpoint_dir`` is set
    tensorboard/, mlruns/, wandb/  the optional sinks
    previous_<k>/                what a fresh start moved aside

Contract:
- ``plan_run_dir(run_dir, ckpt_dir, mode, resume_path, run, overwrite)`` (pure apart from
  reading the folders) decides, on rank 0, what to do and returns a ``RunDirPlan``: the
  checkpoint to resume (or None), what to move aside, or the error line. ``auto`` resumes the
  newest complete ``global_step_N`` of ``ckpt_dir`` only when its run id (``meta.json``) is
  ``run`` (another id is refused naming both); ``path`` resumes ``resume_path`` (which must exist),
  also from another run id (a notice says so: an explicit choice). A resumed run continues its
  run folder. A run that starts from step 0 where run files are (``run_entries``: the names this
  layout lists, never a file hybridrl does not write; a checkpoint folder holding nothing but
  temporary folders does not count) moves them aside when they are its own
  earlier start's (same or no ``run.json``) and no checkpoint is there; it is refused with one
  line when they are another run's, or when ``resume=disable`` finds checkpoints, unless
  ``overwrite``: then all of them, and the checkpoints of ``ckpt_dir`` when it lies outside the
  run folder, are moved into ``previous_<k>/`` (never deleted).
- ``auto`` reads the newest complete checkpoint whose ``meta.json`` is readable: a corrupt one
  is skipped with a warning notice naming the file (as a corrupt ``.pt`` falls back at load).
- ``apply_run_dir(run_dir, ckpt_dir, plan, run, seed, record=True)`` (rank 0 only) creates the
  run folder, removes leftover ``.tmp_global_step_*`` folders (never complete by construction),
  moves aside what the plan says (the notice names where) and, with ``record``, writes
  ``run.json`` (``record_run``; a resume records it only once the checkpoint loaded, so a failed
  resume leaves the folder's files as they were).
- ``keep_steps_upto(path, step, notices=None)`` keeps the lines of a jsonl file whose ``"step"``
  is <= ``step`` and appends the others to ``<stem>.redone.jsonl`` (first, so a crash
  duplicates, never loses); the file is rewritten only when a line moves (atomically). Returns
  the number moved. A half-written last line (no newline, not JSON: the writer died or the
  disk filled) goes to ``<stem>.torn.txt`` and a notice is appended to ``notices``; any other
  line that is not a JSON object with a ``"step"`` raises ``StartupError`` naming file and line.
- ``write_config(run_dir, text)`` writes ``config.yaml``; an existing one with other content is
  renamed ``config-<its mtime, %Y%m%d-%H%M%S>[-k].yaml`` first. Returns that name or None.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from hybridrl.checkpoint.folder import complete_checkpoints, latest_checkpoint
from hybridrl.checkpoint.run_identity import StartupError

RUN_FILE = "run.json"
CONFIG = "config.yaml"
RUN_FILES = (RUN_FILE, CONFIG, "metrics.jsonl", "generations.jsonl", "metrics.redone.jsonl",
             "generations.redone.jsonl", "metrics.torn.txt", "generations.torn.txt", "plot.png",
             "tensorboard", "mlruns", "wandb")


@dataclasses.dataclass
class RunDirPlan:
    resume: str | None = None
    move_aside: list[tuple[str, list[str]]] = dataclasses.field(default_factory=list)
    notice: str | None = None
    error: str | None = None


def _saved_id(folder: Path) -> str | None:
    try:
        return json.loads((folder / "meta.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def _readable_meta(folder: Path) -> str | None:
    """None when ``<folder>/meta.json`` is a JSON object, else why it is not (one phrase)."""
    try:
        data = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None if isinstance(data, dict) else "not a JSON object"


def _recorded_id(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def _inside(path: Path, folder: Path) -> str | None:
    """The first component of ``path`` below ``folder`` ("" for the folder itself), or None."""
    try:
        rel = path.resolve().relative_to(folder.resolve())
    except ValueError:
        return None
    return rel.parts[0] if rel.parts else ""


def _leftover(path: Path) -> bool:
    """A folder holding nothing, or only temporary checkpoint folders (removed at start-up)."""
    return path.is_dir() and all(c.name.startswith(".tmp_global_step_") for c in path.iterdir())


def run_entries(run_dir: Path, ckpt_dir: Path) -> list[str]:
    """Names in ``run_dir`` that a run writes (see the layout above), sorted."""
    if not run_dir.is_dir():
        return []
    top = _inside(ckpt_dir, run_dir)
    return sorted(c.name for c in run_dir.iterdir()
                  if c.name in RUN_FILES or (c.name == top and not _leftover(c))
                  or (c.name.startswith("config-") and c.name.endswith(".yaml"))
                  or (top == "" and c.name.startswith("global_step_")))


def _outside_checkpoints(run_dir: Path, ckpt_dir: Path) -> list[str]:
    if _inside(ckpt_dir, run_dir) is not None or not ckpt_dir.is_dir():
        return []
    return sorted(c.name for c in ckpt_dir.iterdir() if c.name.startswith("global_step_"))


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + ("..." if len(names) > 3 else "")


def plan_run_dir(run_dir: str | Path, ckpt_dir: str | Path, mode: str, resume_path: str,
                 run: str, overwrite: bool) -> RunDirPlan:
    run_dir, ckpt_dir = Path(run_dir), Path(ckpt_dir)
    if mode == "path":
        path = Path(resume_path)
        if not path.is_dir():
            return RunDirPlan(error=f"trainer.resume_path {resume_path!r} does not exist")
        other = _saved_id(path)
        note = (None if other == run else f"resuming {resume_path} of run {other} "
                f"with a different config (run {run}): trainer.resume=path allows it")
        return RunDirPlan(resume=str(path), notice=note)
    latest, skipped = latest_checkpoint(ckpt_dir), []
    if mode == "auto":  # a corrupt meta.json: fall back, as a corrupt .pt does
        for folder in complete_checkpoints(ckpt_dir):
            why = _readable_meta(folder)
            if why is None:
                break
            skipped.append(f"checkpoint file '{folder / 'meta.json'}' cannot be read ({why})")
        else:
            if skipped:
                return RunDirPlan(error=f"trainer.resume=auto: no complete checkpoint in "
                                  f"{str(ckpt_dir)!r} can be read: " + "; ".join(skipped))
        latest = folder if skipped else latest
    if mode == "auto" and latest is not None:
        other = _saved_id(latest)
        if skipped:
            note = "warning: " + "; ".join(skipped) + f"; falling back to {latest}"
            if other == run:
                return RunDirPlan(resume=str(latest), notice=note)
        if other == run:
            return RunDirPlan(resume=str(latest))
        return RunDirPlan(error=(
            f"trainer.resume=auto: {str(ckpt_dir)!r} holds {latest.name} of run {other} but "
            f"this config is run {run} (seed or settings differ); use another "
            "trainer.experiment_name, trainer.resume=disable trainer.overwrite=true, or "
            "trainer.resume=path"))
    mine, outside = run_entries(run_dir, ckpt_dir), _outside_checkpoints(run_dir, ckpt_dir)
    aside = [(str(run_dir), mine)] if mine else []
    aside += [(str(ckpt_dir), outside)] if outside else []
    if not aside:
        return RunDirPlan()
    recorded = _recorded_id(run_dir)
    foreign = recorded is not None and recorded != run
    if overwrite or not (foreign or latest is not None):  # latest: resume=disable here
        whose = f"run {recorded}'s" if recorded else "earlier"
        why = "" if overwrite else " (no checkpoint to resume)"
        return RunDirPlan(move_aside=aside, notice=f"moved {whose} files{why} aside")
    owner = f"run {recorded}'s" if recorded else "the"
    found = _listed([n for _, names in aside for n in names])
    return RunDirPlan(error=(
        f"trainer.resume={mode}: the run folder {str(run_dir)!r} already holds {owner} {found}"
        f"{'' if not outside else f' (checkpoints in {str(ckpt_dir)!r})'}; this is run {run}: "
        "set trainer.overwrite=true to move them aside, or use another trainer.experiment_name"))


def _first_free(folder: Path, stem: str) -> Path:
    k = 0
    while (folder / f"{stem}{k}").exists():
        k += 1
    return folder / f"{stem}{k}"


def apply_run_dir(run_dir: str | Path, ckpt_dir: str | Path, plan: RunDirPlan, run: str,
                  seed: int, record: bool = True) -> None:
    """Rank 0: create, clean temporary folders, move aside, record ``run.json`` (see docstring)."""
    run_dir, ckpt_dir = Path(run_dir), Path(ckpt_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if ckpt_dir.is_dir():
        for child in ckpt_dir.iterdir():
            if child.name.startswith(".tmp_global_step_") and child.is_dir():
                shutil.rmtree(child)
    moved = []
    for folder, names in plan.move_aside:
        dest = _first_free(Path(folder), "previous_")
        dest.mkdir()
        for name in names:
            os.replace(Path(folder) / name, dest / name)
        moved.append(f"{dest} ({len(names)} entries)")
    if moved and plan.notice:
        plan.notice += " into " + ", ".join(moved)
    if record:
        record_run(run_dir, run, seed)


def record_run(run_dir: str | Path, run: str, seed: int) -> None:
    """Write ``run.json`` (atomically): the run that owns the folder."""
    run_dir = Path(run_dir)
    tmp = run_dir / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps({"run_id": run, "seed": seed}) + "\n")
    os.replace(tmp, run_dir / RUN_FILE)


def keep_steps_upto(path: str | Path, step: int, notices: list | None = None) -> int:
    """Move the lines of steps > ``step`` to ``<stem>.redone.jsonl`` (see docstring)."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, later, text = [], [], path.read_text(errors="replace")
    lines = text.splitlines()
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record_step = record.get("step", 0) if isinstance(record, dict) else None
        except ValueError:
            record_step = None
        if record_step is None and k == len(lines) - 1 and not text.endswith("\n"):
            torn = path.with_name(path.stem + ".torn.txt")  # a half-written last line (the
            with open(torn, "a") as f:  # writer died, or the disk filled): kept aside, named
                f.write(line + "\n")
            if notices is not None:
                notices.append(f"{path.name} line {k + 1} was half-written (torn); moved to "
                               f"{torn.name}")
            later.append(None)
            continue
        if not isinstance(record_step, int):
            raise StartupError(f"{str(path)!r} line {k + 1} is not a JSON object with a "
                               f"\"step\" ({line[:60]!r}): repair or remove that line")
        (later if record_step > step else keep).append(line + "\n")
    torn = later.count(None)
    later = [line for line in later if line is not None]
    if later or torn:
        with open(path.with_name(path.stem + ".redone.jsonl"), "a") as f:
            f.write("".join(later))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return len(later)


def write_config(run_dir: str | Path, text: str) -> str | None:
    """Write ``config.yaml``, keeping a different previous one (see docstring)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path, kept = run_dir / CONFIG, None
    if path.is_file() and path.read_text() != text:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        dest, k = run_dir / f"config-{stamp}.yaml", 1
        while dest.exists():
            dest, k = run_dir / f"config-{stamp}-{k}.yaml", k + 1
        os.replace(path, dest)
        kept = dest.name
    path.write_text(text)
    return kept
