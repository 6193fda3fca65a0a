"""An exclusive lock on the run folder, held by rank 0 for the run's life.

Contract:
- ``acquire_run_lock(run_dir, wait_s=LOCK_WAIT_S)`` creates ``run_dir`` when missing, opens
  ``<run_dir>/.hybridrl.lock`` and takes an exclusive ``flock`` on it, retrying for ``wait_s``
  seconds (a run whose launcher was just killed may still be exiting). It then writes the
  holder (``host``, ``pid``, start time) into the file and returns a ``RunLock``; keep it alive
  for the run (the kernel releases the lock when the process ends, however it ends, so a lock
  left by a dead process is simply taken over: its file names the old holder, the lock is free).
- When another live process holds it: ``StartupError`` with one line naming the folder, the
  holder's host and pid (read from the file) and what to do.
- A process that already holds the lock gets it again (a second trainer in one process, as
  tests build them): ``RunLock`` with ``fd`` -1, nothing to release.
- ``RunLock.release()`` unlocks and closes (the file stays: removing it would race a waiter).
- ``acquire_run_locks(run_dir, checkpoint_dir, wait_s)``: the locks over every folder a run
  writes (the run folder, which holds the tracking sinks, and ``trainer.checkpoint_dir``), taken
  by the entrypoint before any model is built. Each folder that is not inside another of them is
  locked as above (a checkpoint folder inside the run folder is covered by the run folder's
  lock: no lock file goes where a fresh start moves things aside); then every enclosing folder
  that has a lock file is locked shared. So a second run refuses to start when any folder it
  would write is a live run's folder or lies inside one (``checkpoint_dir`` pointed at a live
  run's checkpoints included); the line names the folder and the holder. Released when the
  process ends.
- The lock is advisory and local-filesystem grade (``flock``; NFS v4 emulates it).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from hybridrl.checkpoint.run_identity import StartupError

LOCK_FILE = ".hybridrl.lock"
LOCK_WAIT_S = 15.0


class RunLock:
    """An open, locked lock file (see the module docstring)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"host {info.get('host')}, pid {info.get('pid')}"
    except (OSError, ValueError):
        return "holder unknown"


def _mine(path: Path) -> bool:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return info.get("pid") == os.getpid() and info.get("host") == socket.gethostname()


def _lock(path: Path, mode: int, wait_s: float, refusal) -> RunLock:
    """flock ``path`` (created when missing, for an exclusive lock) in ``mode``; ``refusal()`` is
    the line when a live process of another run holds it past ``wait_s``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT if mode == fcntl.LOCK_EX else os.O_RDONLY, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return RunLock(path, fd)
        except BlockingIOError:
            if _mine(path):  # an earlier trainer of this process (tests run several)
                os.close(fd)
                return RunLock(path, -1)
            if time.monotonic() >= deadline:
                os.close(fd)
                raise StartupError(refusal()) from None
            time.sleep(0.2)


def _record_holder(lock: RunLock) -> None:
    if lock.fd >= 0:
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(lock.fd, 0)
        os.pwrite(lock.fd, (json.dumps(info) + "\n").encode(), 0)


def acquire_run_lock(run_dir: str | Path, wait_s: float = LOCK_WAIT_S) -> RunLock:
    """Lock ``run_dir`` for this process (see the module docstring)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    lock = _lock(path, fcntl.LOCK_EX, wait_s, lambda: (
        f"the run folder {str(run_dir)!r} is in use by another run ({_holder(path)}; "
        f"lock file {path}): wait for it to end, or use another trainer.experiment_name"))
    _record_holder(lock)
    return lock


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def acquire_run_locks(run_dir: str | Path, checkpoint_dir: str | Path = "",
                      wait_s: float = LOCK_WAIT_S) -> list[RunLock]:
    """The locks over every folder the run writes (see the module docstring)."""
    named = [(Path(os.path.realpath(run_dir)), "the run folder", "trainer.experiment_name")]
    if checkpoint_dir:
        named.append((Path(os.path.realpath(checkpoint_dir)), "trainer.checkpoint_dir",
                      "trainer.checkpoint_dir"))
    own = [(f, what, key) for f, what, key in named
           if not any(o != f and _within(f, o) for o, _, _ in named)]
    locks = []
    try:
        for folder, what, key in own:
            if what == "the run folder":
                locks.append(acquire_run_lock(folder, wait_s))
                continue
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / LOCK_FILE
            locks.append(_lock(path, fcntl.LOCK_EX, wait_s, lambda f=folder, p=path, w=what, k=key: (
                f"{w} {str(f)!r} is in use by another run ({_holder(p)}; lock file {p}): wait "
                f"for it to end, or set another {k}")))
            _record_holder(locks[-1])
        for folder, what, key in named:
            for outer in folder.parents:
                path = outer / LOCK_FILE
                if any(_within(outer, o) for o, _, _ in own) or not path.exists():
                    continue
                locks.append(_lock(path, fcntl.LOCK_SH, wait_s, lambda o=outer, p=path, w=what,
                                   f=folder, k=key: (
                    f"{w} {str(f)!r} lies inside {str(o)!r}, a folder of another run in "
                    f"progress ({_holder(p)}; lock file {p}): set another {k}")))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks
