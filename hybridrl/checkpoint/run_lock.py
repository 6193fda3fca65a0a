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


def acquire_run_lock(run_dir: str | Path, wait_s: float = LOCK_WAIT_S) -> RunLock:
    """Lock ``run_dir`` for this process (see the module docstring)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if _mine(path):  # an earlier trainer of this process (tests run several)
                os.close(fd)
                return RunLock(path, -1)
            if time.monotonic() >= deadline:
                os.close(fd)
                raise StartupError(
                    f"the run folder {str(run_dir)!r} is in use by another run ({_holder(path)}; "
                    f"lock file {path}): wait for it to end, or use another "
                    "trainer.experiment_name") from None
            time.sleep(0.2)
    info = {"host": socket.gethostname(), "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return RunLock(path, fd)
