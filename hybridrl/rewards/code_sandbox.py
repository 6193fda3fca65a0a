"""The code reward's sandbox init: run inside fresh namespaces, it builds the candidate's world.

Contract: started by ``hybridrl.rewards.sandbox`` as ``PYTHON -I -S code_sandbox.py CONFIG_JSON``
(host side, the trainer's user). It forks; the child ``unshare(2)``s a user namespace, whose
uid/gid 0 the parent maps (to ``nobody`` when the trainer runs as host root: the kernel exempts
the host's root user from RLIMIT_NPROC, and root owns most files; else to the trainer's user,
as ``unshare -r`` does), then mount, PID, network, IPC and UTS namespaces, and forks again: that
grandchild is pid 1 of the new PID namespace, root of the new user namespace (no rights outside
it), with no network but a down loopback. Before it ``execve``s the candidate it
- mounts a private tmpfs (``tmpfs_mb``) on the empty directory ``root`` and makes it the root
  (``pivot_root``; the old root is detached, so no path leads back to the host): inside are only
  ``/usr`` and the interpreter's prefix (bind mounts, read-only, nosuid, nodev), ``/dev/null``,
  ``/dev/zero``, ``/dev/urandom``, ``/dev/random``, a ``/proc`` of the new PID namespace
  (an empty ``/proc`` where the kernel refuses to mount one: a container's masked /proc),
  ``/tmp`` and ``/work`` (world-writable, on the tmpfs) holding the ``files`` it was given;
- becomes uid/gid 0 of its namespace with no supplementary groups, sets rlimits (address space,
  CPU seconds, file size, open files, processes, no core files), empties every capability set
  (bounding, ambient, inheritable, permitted, effective) and sets ``no_new_privs``;
- on x86-64, installs a seccomp filter: mount/namespace/ptrace/bpf/keyring/io_uring/module
  syscalls and ``clone`` with namespace flags fail with EPERM (``clone3`` with ENOSYS, so libc
  falls back to ``clone``), x32 syscalls fail;
- moves the result descriptor to fd 3, closes the others and ``execve``s ``argv`` in ``/work``
  with ``env``. A failure of any step prints ``hybridrl-sandbox: <step>: <error>`` on stderr and
  exits 125: the candidate never runs with less isolation than described. Each process
  outside the new PID namespace waits for its child and exits with its status (128 + the
  signal that ended it), and dies with its parent (``PR_SET_PDEATHSIG``): a trainer killed
  with SIGKILL takes its candidates along.
Stdlib only (ctypes for the syscalls Python does not wrap): it runs in a bare interpreter.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import struct
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
SETUP_FAILED = 125
_STATVFS_TO_MS = ((os.ST_RDONLY, MS_RDONLY), (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV),
                  (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME),
                  (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
_DEVICES = ("null", "zero", "urandom", "random")
# x86-64 syscall numbers refused by the seccomp filter (EPERM)
_DENY_X86_64 = (101, 103, 135, 155, 161, 163, 165, 166, 167, 168, 169, 175, 176, 179, 246, 248,
                249, 250, 272, 298, 303, 304, 308, 310, 311, 313, 320, 321, 323, 425, 426, 427,
                428, 429, 430, 431, 432, 433, 442)
_CLONE, _CLONE3 = 56, 435
_CLONE_NS_FLAGS = 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
_AUDIT_ARCH_X86_64 = 0xC000003E


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, src, target, fstype, flags, data=None) -> None:
    def enc(value):
        return None if value is None else os.fsencode(value)

    _ok(libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {target}")


def _bind_readonly(libc, src_fd: int, target: str) -> None:
    os.makedirs(target, exist_ok=True)
    _mount(libc, f"/proc/self/fd/{src_fd}", target, None, MS_BIND | MS_REC)
    locked = os.fstatvfs(src_fd).f_flag  # flags the host mount has must be kept on a remount
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    flags |= sum(ms for st, ms in _STATVFS_TO_MS if locked & st)
    _mount(libc, None, target, None, flags)


def _open_host_side(cfg: dict) -> tuple[dict, dict, dict]:
    """What the new root needs from the host, taken while this process still has the host
    user's access (the interpreter's prefix may be under a 0700 home): O_PATH descriptors of
    the bind sources and devices, the input files' bytes, the symlinks' targets."""
    links = {p: os.readlink(p) for p in cfg["binds"] if os.path.islink(p)}
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in cfg["binds"]
           if p not in links and os.path.isdir(p)}
    fds.update({f"/dev/{n}": os.open(f"/dev/{n}", os.O_PATH) for n in _DEVICES})
    data = {}
    for name, host_path in cfg["files"].items():
        with open(host_path, "rb") as f:
            data[name] = f.read()
    return links, fds, data


def _become_namespace_root() -> None:
    """uid/gid 0 of the namespace (mapped outside), no supplementary groups; the capabilities
    in the namespace are kept until ``_drop_privileges``."""
    try:
        os.setgroups([])
    except OSError:  # setgroups denied (unprivileged map): there are no groups to drop
        pass
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


def _build_root(libc, cfg: dict, links: dict, fds: dict, data: dict) -> None:
    root = cfg["root"]
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmpfs_mb']}m,mode=755")
    for path, target in links.items():  # merged /usr: /bin -> usr/bin
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    for path in cfg["binds"]:
        if path in fds:
            _bind_readonly(libc, fds[path], root + path)
    os.makedirs(root + "/dev", exist_ok=True)
    for name in _DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        _mount(libc, f"/proc/self/fd/{fds['/dev/' + name]}", f"{root}/dev/{name}", None, MS_BIND)
    for fd in fds.values():
        os.close(fd)
    os.makedirs(root + "/proc")
    try:
        _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:  # refused where the host's /proc has masked paths (containers): go without
        pass
    for name in ("tmp", "work"):
        os.makedirs(f"{root}/{name}")
        os.chmod(f"{root}/{name}", 0o1777)
    for name, content in data.items():
        with open(f"{root}/work/{name}", "wb") as dst:
            dst.write(content)
        os.chmod(f"{root}/work/{name}", 0o644)
    os.makedirs(root + "/.old")
    _ok(libc.syscall(ctypes.c_long(_pivot_root_nr()), os.fsencode(root),
                     os.fsencode(root + "/.old")), "pivot_root")
    os.chdir("/")
    _ok(libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")


def _pivot_root_nr() -> int:
    return {"x86_64": 155, "aarch64": 41}[platform.machine()]


def _drop_privileges(libc, limits: dict) -> None:
    for res, value in ((resource.RLIMIT_AS, limits["memory_mb"] << 20),
                       (resource.RLIMIT_FSIZE, limits["max_file_bytes"]),
                       (resource.RLIMIT_NOFILE, limits["max_open_files"]),
                       (resource.RLIMIT_NPROC, limits["max_processes"]),
                       (resource.RLIMIT_CORE, 0), (resource.RLIMIT_MEMLOCK, 0)):
        resource.setrlimit(res, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    for cap in range(limits["last_cap"] + 1):
        _ok(libc.prctl(24, cap, 0, 0, 0), "drop bounding capability")  # PR_CAPBSET_DROP
    _ok(libc.prctl(47, 4, 0, 0, 0), "clear ambient capabilities")  # PR_CAP_AMBIENT CLEAR_ALL
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = ctypes.create_string_buffer(24)  # two all-zero {effective, permitted, inheritable}
    _ok(libc.capset(ctypes.c_char_p(header), data), "capset")
    _ok(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")  # PR_SET_NO_NEW_PRIVS


def _seccomp_program() -> bytes:
    """The filter described in the module docstring, as classic BPF instructions."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38
    n_checks = len(_DENY_X86_64)
    # layout: 0 ld arch, 1 jeq, 2 ret kill, 3 ld nr, 4 jge x32, 5.. jeq deny, clone3, clone,
    # ld arg0, jset, ret allow, ret eperm, ret enosys
    base = 5 + n_checks
    allow_at, deny_at, nosys_at = base + 4, base + 5, base + 6
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, _AUDIT_ARCH_X86_64), (ret, 0, 0, kill), (ld, 0, 0, 0),
            (jge, deny_at - 5, 0, 0x40000000)]
    for k, nr in enumerate(_DENY_X86_64):
        pc = 5 + k
        prog.append((jeq, deny_at - pc - 1, 0, nr))
    prog.append((jeq, nosys_at - base - 1, 0, _CLONE3))
    prog.append((jeq, 0, allow_at - base - 2, _CLONE))
    prog.append((ld, 0, 0, 16))  # low 32 bits of args[0] (clone flags)
    prog.append((jset, deny_at - base - 4, 0, _CLONE_NS_FLAGS))
    prog += [(ret, 0, 0, allow), (ret, 0, 0, eperm), (ret, 0, 0, enosys)]
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def _install_seccomp(libc) -> None:
    if platform.machine() != "x86_64":
        return  # namespaces, dropped capabilities and rlimits still hold (docs/algorithms.md)
    code = _seccomp_program()
    buf = ctypes.create_string_buffer(code, len(code))
    prog = struct.pack("HxxxxxxQ", len(code) // 8, ctypes.addressof(buf))
    _ok(libc.prctl(22, 2, ctypes.c_char_p(prog), 0, 0), "seccomp")  # SET_SECCOMP, MODE_FILTER


def _fail(step: str, err: BaseException) -> None:
    os.write(2, f"hybridrl-sandbox: {step}: {err}\n".encode())
    os._exit(SETUP_FAILED)


def _status_code(status: int) -> int:
    """A child's wait status as an exit code: n, or 128 + the signal that ended it."""
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _candidate(libc, cfg: dict) -> None:
    """Pid 1 of the new PID namespace: build the world, drop everything, become the candidate."""
    step = "pdeathsig"
    try:
        _ok(libc.prctl(1, 9, 0, 0, 0), step)  # PR_SET_PDEATHSIG SIGKILL
        step = "host side"
        links, fds, data = _open_host_side(cfg)
        with open("/proc/sys/kernel/cap_last_cap") as f:  # the host's /proc, read while here
            cfg["limits"]["last_cap"] = int(f.read())
        step = "user"
        _become_namespace_root()
        step = "root"
        _build_root(libc, cfg, links, fds, data)
        step = "privileges"
        _drop_privileges(libc, cfg["limits"])
        step = "seccomp"
        _install_seccomp(libc)
        step = "exec"
        _ok(libc.prctl(1, 9, 0, 0, 0), "pdeathsig")  # again: the uid change cleared it
        os.chdir("/work")
        keep = 3
        if cfg.get("result_fd") is not None:
            keep = os.dup2(cfg["result_fd"], 3) + 1
            os.set_inheritable(3, True)
        os.closerange(keep, 1 << 16)
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except Exception as err:  # noqa: BLE001 - any failure: the candidate does not run
        _fail(step, err)


def _in_user_namespace(libc, cfg: dict, ready_w: int, mapped_r: int, parent: int) -> None:
    """The child: a new user namespace (mapped by the parent), then the other namespaces and
    a fork, whose child is pid 1 of the new PID namespace; exits with that child's status."""
    step = "user namespace"
    try:
        _ok(libc.unshare(CLONE_NEWUSER), step)
        os.write(ready_w, b"u")
        step = "user map"
        if os.read(mapped_r, 1) != b"m":
            raise OSError("the parent could not write the uid/gid maps")
        step = "namespaces"
        _ok(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS),
            step)
        step = "pdeathsig"  # set after the unshares (new credentials clear it): the parent's
        child = [0]  # death sends SIGTERM here, which kills the namespace's pid 1 (the candidate
        # may clear its own death signal; this process it cannot reach)
        signal.signal(signal.SIGTERM, lambda *_: (child[0] and os.kill(child[0], signal.SIGKILL),
                                                  os._exit(128 + signal.SIGKILL)))
        _ok(libc.prctl(1, signal.SIGTERM, 0, 0, 0), step)
        if os.getppid() != parent:
            raise OSError("the sandbox's parent process is gone")
        pid = child[0] = os.fork()
    except Exception as err:  # noqa: BLE001
        _fail(step, err)
    if pid == 0:
        _candidate(libc, cfg)
    os._exit(_status_code(os.waitpid(pid, 0)[1]))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    libc = _libc()
    if libc.prctl(1, 9, 0, 0, 0) != 0 or os.getppid() != cfg["parent_pid"]:  # PDEATHSIG:
        _fail("pdeathsig", OSError("the trainer's process is gone"))  # a killed trainer ends all
    ready_r, ready_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(mapped_w)
        _in_user_namespace(libc, cfg, ready_w, mapped_r, parent)
    os.close(ready_w)
    os.close(mapped_r)
    if os.read(ready_r, 1) == b"u":
        try:  # host root: uid 0 inside is 'nobody' outside (the host root is exempt from
            # RLIMIT_NPROC and owns most files); otherwise this user, as unshare -r maps it
            outer_uid, outer_gid = (65534, 65534) if os.geteuid() == 0 else (os.geteuid(),
                                                                               os.getegid())
            if os.geteuid() != 0:
                with open(f"/proc/{pid}/setgroups", "w") as f:
                    f.write("deny")
            with open(f"/proc/{pid}/uid_map", "w") as f:
                f.write(f"0 {outer_uid} 1\n")
            with open(f"/proc/{pid}/gid_map", "w") as f:
                f.write(f"0 {outer_gid} 1\n")
            os.write(mapped_w, b"m")
        except OSError as err:
            os.write(2, f"hybridrl-sandbox: user map: {err}\n".encode())
    os.close(mapped_w)
    os._exit(_status_code(os.waitpid(pid, 0)[1]))


if __name__ == "__main__":
    main()
