"""The trusted side of the code sandbox: start a candidate program isolated by the OS, collect
what it wrote, leave nothing running.

Contract:
- ``Sandbox(tmpfs_mb=64, launcher=())``; ``check()`` starts one trivial program the full way
  (namespaces, new root, dropped privileges, seccomp) once per instance and raises
  ``SandboxUnavailable`` (a ``RuntimeError``, one line with the step that failed and its error)
  when that fails: where the kernel refuses unprivileged namespaces the code reward refuses to
  run instead of running candidates with weaker isolation. ``run`` calls ``check`` first.
  ``launcher``: a command prefix for the init (tests use it to simulate a refusing kernel).
- ``run(argv, files, stdin, limits, timeout_s) -> RunResult``: ``files`` ({name: bytes}) are
  copied into the candidate's ``/work`` (its working directory); ``argv`` runs there under the
  interpreter ``sandbox_python()`` (``argv[0]`` may be ``"python"``); ``stdin`` (bytes) is its
  standard input; ``limits`` = {memory_mb, cpu_s, max_file_bytes, max_open_files,
  max_processes} (see ``hybridrl.rewards.code_sandbox``). Standard output, standard error and
  fd 3 (``result``) go to files in a directory of this process that the candidate cannot see;
  each is read up to ``max_file_bytes`` (the file-size limit also stops the writer).
  ``timed_out`` when it had not ended within ``timeout_s`` of wall time: then the namespace's
  pid 1 and the init's processes outside it are killed. When ``run`` returns, the PID namespace is gone (its pid 1
  exited, so the kernel ended every process in it) and the temp directory is deleted.
- ``returncode``: the candidate's exit status, negative for a signal; 125 with a
  ``hybridrl-sandbox:`` line on stderr when the sandbox could not be built for this run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from hybridrl.rewards import code_sandbox

_INIT = os.path.abspath(code_sandbox.__file__)
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
SETUP_FAILED = code_sandbox.SETUP_FAILED


class SandboxUnavailable(RuntimeError):
    """The OS sandbox cannot be built on this machine (the code reward refuses to run)."""


@dataclasses.dataclass(frozen=True)
class RunResult:
    returncode: int
    stdout: bytes
    stderr: bytes
    result: bytes
    timed_out: bool


def sandbox_python() -> str:
    """The base interpreter (a venv's python points into a prefix the sandbox does not show)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _binds() -> list[str]:
    exe = sandbox_python()
    prefixes = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(exe))}
    paths = ["/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32"]
    paths += sorted(p for p in prefixes if not p.startswith("/usr/") and p != "/usr")
    return [p for p in paths if os.path.lexists(p)]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _descendants(pid: int, depth: int = 3) -> list[int]:
    """The init's child and grandchild (the namespace's pid 1), nearest first."""
    found, level = [], [pid]
    for _ in range(depth):
        level = [c for p in level for c in _children(p)]
        found += level
    return found


def _read(path: str, cap: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(cap)


class Sandbox:
    """Runs candidate programs isolated by the OS (see the module docstring)."""

    def __init__(self, tmpfs_mb: int = 64, launcher: tuple[str, ...] = ()) -> None:
        self.tmpfs_mb, self.launcher = int(tmpfs_mb), tuple(launcher)
        self._checked: str | None = None  # "" once it worked, else the refusal line
        self._lock = threading.Lock()

    def check(self) -> None:
        """Raise SandboxUnavailable (one line) unless a trivial program runs fully isolated."""
        with self._lock:
            if self._checked is None:
                self._checked = self._probe()
        if self._checked:
            raise SandboxUnavailable(self._checked)

    def _probe(self) -> str:
        limits = {"memory_mb": 256, "cpu_s": 10, "max_file_bytes": 1 << 16,
                  "max_open_files": 64, "max_processes": 8}
        try:
            res = self._run(["python", "-c", "print('ok')"], {}, b"", limits, 60.0)
        except OSError as err:
            res = None
            why = f"{(self.launcher or ('python',))[0]}: {err.strerror or err}"
        if res is not None:
            if res.returncode == 0 and res.stdout.strip() == b"ok":
                return ""
            lines = [ln for ln in res.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
            why = lines[-1].strip() if lines else f"exit status {res.returncode}"
        return (f"code reward: the OS sandbox cannot start here ({why}); it needs unprivileged "
                "user, PID, network, mount and IPC namespaces (util-linux unshare, Linux >= 5.14, "
                "user namespaces enabled); candidates are never run with weaker isolation")

    def run(self, argv: list[str], files: dict[str, bytes], stdin: bytes, limits: dict,
            timeout_s: float) -> RunResult:
        """One candidate run (see the module docstring)."""
        self.check()
        return self._run(argv, files, stdin, limits, timeout_s)

    def _run(self, argv, files, stdin, limits, timeout_s) -> RunResult:
        work = tempfile.mkdtemp(prefix="hybridrl-code-")
        try:
            os.chmod(work, 0o711)  # the sandbox's own user passes through to root/ only
            os.mkdir(os.path.join(work, "root"), 0o755)
            os.mkdir(os.path.join(work, "in"))
            host_files = {}
            for name, data in files.items():
                host_files[name] = os.path.join(work, "in", name)
                with open(host_files[name], "wb") as f:
                    f.write(data)
            paths = {k: os.path.join(work, k) for k in ("stdin", "stdout", "stderr", "result")}
            with open(paths["stdin"], "wb") as f:
                f.write(stdin)
            python = sandbox_python()
            with contextlib.ExitStack() as stack:
                fin = stack.enter_context(open(paths["stdin"], "rb"))
                fout, ferr, fres = (stack.enter_context(open(paths[k], "wb"))
                                    for k in ("stdout", "stderr", "result"))
                cfg = {"root": os.path.join(work, "root"), "tmpfs_mb": self.tmpfs_mb,
                       "binds": _binds(), "files": host_files, "limits": limits,
                       "result_fd": fres.fileno(), "env": _ENV, "parent_pid": os.getpid(),
                       "argv": [python if argv[0] == "python" else argv[0], *argv[1:]]}
                cmd = [*self.launcher, python, "-I", "-S", _INIT, json.dumps(cfg)]
                proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr,
                                        pass_fds=(fres.fileno(),), start_new_session=True,
                                        env=_ENV)
                timed_out = False
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    self._kill(proc)
                except BaseException:
                    self._kill(proc)
                    raise
            cap = int(limits["max_file_bytes"])
            rc = proc.returncode
            if rc is not None and 128 < rc < 128 + 65:  # the init reports a signal so
                rc = -(rc - 128)
            return RunResult(rc, _read(paths["stdout"], cap), _read(paths["stderr"], cap),
                             _read(paths["result"], cap), timed_out)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """Kill the namespace's pid 1 (the kernel then ends the rest) and the launcher."""
        for pid in reversed(_descendants(proc.pid)):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
