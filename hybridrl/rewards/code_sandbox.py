"""The child side of the code reward's sandbox: limits, an audit hook, then the solution.

Contract: run as ``python -I code_sandbox.py LIMITS_JSON SOLUTION_FILE`` with the working
directory a fresh temp dir (``hybridrl.rewards.code`` does). Before the solution runs it
- sets ``resource`` limits: address space (``memory_mb``), CPU seconds, file size
  (``max_file_bytes``: also bounds stdout, which is a file), no core files, few open files;
- installs a ``sys.addaudithook`` hook (hooks cannot be removed) that raises
  ``PermissionError("sandbox: ...")`` on: opening a file for writing outside the working
  directory, creating / renaming / removing paths outside it, sockets, subprocesses, fork/exec,
  ctypes (``ctypes.dlopen``) and changing limits back.
Defence in depth: the parent also runs it without a network namespace when ``unshare -rn`` works,
with a minimal environment and a wall-clock timeout. An audit hook is not a boundary against
hostile native code; it stops what reward tasks' solutions do by accident (and most on purpose).
Stdlib only: this file must run in a bare interpreter.
"""

import json
import os
import resource
import sys

_BLOCKED = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.fork", "os.forkpty",
            "os.posix_spawn", "os.spawn", "os.kill", "os.killpg", "ctypes.dlopen", "pty.spawn",
            "resource.setrlimit", "os.chdir", "os.chroot", "sys.addaudithook")
_PATH_EVENTS = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown",
                "os.symlink", "os.link", "os.truncate", "shutil.rmtree", "os.utime")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _inside(path, root) -> bool:
    if isinstance(path, int):
        return True  # an fd already open (stdout, stderr, ...)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    real = os.path.realpath(os.path.join(root, str(path)))
    return real == root or real.startswith(root + os.sep)


def _hook(root):
    def hook(event, args):
        if event.startswith(_BLOCKED):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writing and not _inside(path, root):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in _PATH_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not _inside(path, root):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the working "
                                          "directory")
    return hook


def main() -> None:
    limits, solution = json.loads(sys.argv[1]), sys.argv[2]
    mem = limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    size = limits["max_file_bytes"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    with open(solution, encoding="utf-8") as f:
        source = f.read()
    code = compile(source, "solution.py", "exec")
    root = os.path.realpath(os.getcwd())
    sys.argv = ["solution.py"]
    sys.addaudithook(_hook(root))
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
