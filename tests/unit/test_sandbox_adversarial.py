"""The code reward against hostile candidates (issue 43): programs a policy could sample to be
paid without solving the task, or to reach the trainer. Each must score 0, leave nothing
written outside the sandbox and nothing running, and the scorer must keep scoring afterwards.

The cases run in parallel (a thread pool: each run is a few short processes). Where the kernel
refuses the namespaces, the suite is skipped with the sandbox's own reason and the test at the
bottom checks that the code reward then refuses to run at all.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import uuid

import pytest

from hybridrl.rewards import code as code_reward
from hybridrl.rewards.distributed import RowItem, score_rows
from hybridrl.rewards.sandbox import Sandbox, SandboxUnavailable, sandbox_python
from hybridrl.rewards.scoring import RewardScorer

ASSERTS = {"assert": "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15"}
STDIO = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
WRONG = "\ndef add(a, b):\n    return a * b\n"  # right on no case above
OFF_HOOK = ("import sys\nm = sys.modules['__main__']\nm._BLOCKED = ('-',)\n"
            "m._PATH_EVENTS = ()\nm._inside = lambda *a: True\n")


def _sandbox_or_skip() -> None:
    try:
        code_reward.default_sandbox().check()
    except SandboxUnavailable as err:
        pytest.skip(str(err))


def _hostile(tmp, victim: int, port: int, token: str) -> dict[str, tuple[str, dict]]:
    """name -> (program, tests). ``tmp``: a host folder nothing may appear in; ``victim``: a
    host process nothing may signal; ``port``: a host listener nothing may reach; ``token``:
    marks processes that must not outlive their score."""
    out = str(tmp / "escaped")
    sleeper = f"[{sandbox_python()!r}, '-c', 'import time; time.sleep(300)', '{token}']"
    try_ = "try:\n    {}\nexcept BaseException:\n    pass\n".format
    return {
        "audit_hook_switched_off": (  # the old hook read these globals of __main__
            OFF_HOOK + try_(f"open({out!r}, 'w').write('x')") + WRONG, ASSERTS),
        "dir_fd_open": (
            "import os\n" + try_(f"d = os.open({str(tmp)!r}, os.O_RDONLY); "
                                 "os.close(os.open('escaped', os.O_CREAT | os.O_WRONLY, "
                                 "dir_fd=d))") + WRONG, ASSERTS),
        "dir_fd_remove": (
            "import os\n" + try_(f"d = os.open({str(tmp)!r}, os.O_RDONLY); "
                                 "os.remove('keep', dir_fd=d)") + WRONG, ASSERTS),
        "sqlite": ("import sqlite3\n" + try_(f"sqlite3.connect({out!r}).execute('create table t"
                                             "(x)')") + WRONG, ASSERTS),
        "mkfifo": ("import os\n" + try_(f"os.mkfifo({out!r})") + WRONG, ASSERTS),
        "fork_exec": ("import subprocess\n" + try_(f"subprocess.run(['sh', '-c', 'echo x > "
                                                   f"{out}'])") + WRONG, ASSERTS),
        "ctypes_system": ("import ctypes\n" + try_(f"ctypes.CDLL(None).system(b'echo x > "
                                                   f"{out}')") + WRONG, ASSERTS),
        "ctypes_remount_rw": (
            "import ctypes\n" + try_("ctypes.CDLL(None).mount(None, b'/usr', None, 32 | 4096, "
                                     "None); open('/usr/escaped', 'w')") + WRONG, ASSERTS),
        "pidfd_kill_parent": (
            "import os, signal\n" + try_("signal.pidfd_send_signal(os.pidfd_open(os.getppid()),"
                                         " 9)") + try_(f"os.kill({victim}, 9)") + WRONG,
            ASSERTS),
        "prlimit_parent": (
            "import os, resource\n"
            + try_(f"resource.prlimit({victim}, resource.RLIMIT_NOFILE, (1, 1))")
            + try_("resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (1, 1))") + WRONG,
            ASSERTS),
        "early_exit_os": (WRONG + "import os\nos._exit(0)\n", ASSERTS),
        "early_exit_systemexit": (WRONG + "raise SystemExit(0)\n", ASSERTS),
        "forged_results": (  # writes 'passing' lines itself, without knowing what is expected
            WRONG + "import os, json\nfor i in range(3):\n"
            "    os.write(3, (json.dumps({'i': i, 'repr': 'True'}) + '\\n').encode())\n"
            "os._exit(0)\n", ASSERTS),
        "reads_the_tests": (  # looks for the expected values wherever it can read
            "import os, re\nseen = ''\nfor d in ('.', '/work', '/tmp', '/proc/1'):\n"
            "    for n in os.listdir(d):\n" + "        " + try_(
                "seen += open(os.path.join(d, n), errors='replace').read()").replace(
                "\n", "\n        ").rstrip() + "\n"
            "vals = [int(v) for v in re.findall(r'== *(-?[0-9]+)', seen)]\n"
            "def add(a, b):\n    return vals.pop(0) if vals else a * b\n", ASSERTS),
        "fork_bomb": ("import os\nfor _ in range(10000):\n" + "    " + try_(
            "os.fork()").replace("\n", "\n    ").rstrip() + "\n" + WRONG, ASSERTS),
        "memory": ("x = bytearray(8 << 30)\n" + WRONG, ASSERTS),
        "disk": ("import os\nfor i in range(1000):\n" + "    " + try_(
            "open(f'/tmp/f{i}', 'wb').write(os.urandom(1 << 20))").replace(
            "\n", "\n    ").rstrip() + "\n" + WRONG, ASSERTS),
        "open_files": ("fs = []\nfor _ in range(100000):\n" + "    " + try_(
            "fs.append(open('/dev/null'))").replace("\n", "\n    ").rstrip() + "\n" + WRONG,
            ASSERTS),
        "left_behind": (
            OFF_HOOK + f"import os, subprocess\n"
            f"subprocess.Popen({sleeper}, start_new_session=True)\n"
            f"if os.fork() == 0:\n    os.setsid()\n    subprocess.Popen({sleeper})\n"
            "    os._exit(0)\n" + WRONG, ASSERTS),
        "network_loopback": (
            "import socket\n" + try_(f"socket.create_connection(('127.0.0.1', {port}), "
                                     "timeout=1).sendall(b'x')")
            + "a, b = map(int, input().split())\nprint(a * b)\n", STDIO),
        "unshare_again": (  # seccomp: no new namespaces (a nested user ns would regain caps)
            "import ctypes\nif ctypes.CDLL(None).unshare(0x10000000) == 0:\n"
            f"    open({out!r}, 'w')\n" + WRONG, ASSERTS),
    }


def _token_processes(token: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def test_hostile_candidates_score_zero_and_leave_nothing(tmp_path):
    _sandbox_or_skip()
    (tmp_path / "keep").write_text("must survive")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    token = f"hybridrl-left-behind-{uuid.uuid4().hex}"
    cases = _hostile(tmp_path, victim.pid, listener.getsockname()[1], token)
    try:
        def score(item):
            program, tests = item
            return code_reward.compute_score("code", f"```python\n{program}```", tests,
                                             timeout_s=3, memory_mb=256)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = dict(zip(cases, pool.map(score, cases.values())))
        elapsed = time.perf_counter() - t0
        paid = {name: r for name, r in results.items() if r["score"] != 0.0}
        assert not paid, paid
        assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
        assert (tmp_path / "keep").read_text() == "must survive"
        assert victim.poll() is None, "a candidate signalled a host process"
        with pytest.raises(BlockingIOError):
            listener.accept()
        assert _token_processes(token) == []
        assert not os.path.exists("/usr/escaped")
        # the trainer's path keeps going: rows through score_rows (a thread per call, the
        # reward timeout), the hostile ones 0, a right answer after them still paid
        right = "def add(a, b):\n    return a + b\n"
        picked = ["pidfd_kill_parent", "early_exit_os", "forged_results", "left_behind"]
        items = [RowItem(k, f"```python\n{cases[name][0]}```", [1], json.dumps(cases[name][1]),
                         "code", {"index": k}) for k, name in enumerate(picked)]
        items.append(RowItem(len(items), f"```python\n{right}```", [1], json.dumps(ASSERTS),
                             "code", None))
        rows = score_rows(RewardScorer(), items, timeout_s=60)
        assert not isinstance(rows, str), rows  # no error line: the run goes on
        assert [r.final for r in rows] == [0.0] * len(picked) + [1.0]
        assert victim.poll() is None and _token_processes(token) == []
        assert elapsed < 60, elapsed
    finally:
        victim.kill()
        victim.wait()
        listener.close()


def test_candidate_world_is_bare():
    """What a candidate sees: no capabilities, seccomp on, pid 1 of its own PID namespace with
    no parent, only the sandbox's own folders, no network interface but loopback."""
    _sandbox_or_skip()
    probe = ("import json, os\nproc = os.path.exists('/proc/self/status')\n"
             "st = open('/proc/self/status').read() if proc else ''\n"
             "print(json.dumps([proc and st.split('CapEff:')[1].split()[0], "
             "proc and st.split('Seccomp:')[1].split()[0], os.getpid(), os.getppid(), "
             "sorted(os.listdir('/')), proc and open('/proc/net/dev').read().count(':'), "
             "os.path.exists('/proc/1/root/work/main')]))\n")
    res = code_reward.default_sandbox().run(
        ["python", "-I", "-S", "p.py"], {"p.py": probe.encode()}, b"",
        {"memory_mb": 256, "cpu_s": 5, "max_file_bytes": 1 << 16, "max_open_files": 64,
         "max_processes": 8}, 20)
    assert res.returncode == 0, res.stderr
    cap, seccomp, pid, ppid, top, interfaces, sees_repo = json.loads(res.stdout)
    assert {"work", "tmp", "usr", "proc", "dev"} <= set(top), top
    assert not {"home", "etc", "var", "mnt", "opt", "srv"} & set(top), top
    assert (pid, ppid, sees_repo) == (1, 0, False)
    if cap is False:
        pytest.skip("no /proc inside the sandbox here (the kernel refused to mount one, e.g. a "
                    "container's masked /proc): capabilities and seccomp are not observable")
    assert (cap, seccomp) == ("0000000000000000", "2")
    assert interfaces == 1  # /proc/net/dev: 'lo' only


def test_refused_namespaces_refuse_the_code_reward(tmp_path):
    """A kernel that refuses user namespaces (simulated: a parent namespace whose limit is 0,
    or a launcher that fails): one line, and no candidate runs at all."""
    marker = tmp_path / "ran"
    program = f"open({str(marker)!r}, 'w').write('x')\nprint(3)\n"
    boxes = [Sandbox(launcher=("false",))]
    if subprocess.run(["unshare", "--user", "--map-root-user", "true"],
                      capture_output=True).returncode == 0:
        boxes.append(Sandbox(launcher=(
            "unshare", "--user", "--map-root-user", "sh", "-c",
            'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "sh")))
    for box in boxes:
        with pytest.raises(SandboxUnavailable) as info:
            code_reward.run_tests(program, {"inputs": [""], "outputs": ["3"]}, sandbox=box)
        line = str(info.value)
        assert "\n" not in line and "cannot start here" in line
        assert not marker.exists()
    if len(boxes) > 1:
        assert "user namespace" in line and "No space left" in line, line


def test_a_run_with_code_rows_refuses_to_start_where_the_sandbox_cannot(tmp_path, monkeypatch):
    """The entrypoint's start-up check (every rank, before any collective): one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridrl.config.loader import load_config
    from hybridrl.trainer.startup import code_sandbox_problems

    rows = {"data_source": ["hybridrl/arithmetic", "code"], "prompt": [[{"role": "user",
                                                                          "content": "x"}]] * 2}
    pq.write_table(pa.table(rows), tmp_path / "d.parquet")
    cfg = load_config([], [f"data.train_files=[{tmp_path / 'd.parquet'}]"])
    monkeypatch.setattr(code_reward, "default_sandbox", lambda: Sandbox(launcher=("false",)))
    (line,) = code_sandbox_problems(cfg)
    assert "has 'code' rows but code reward: the OS sandbox cannot start here" in line
    assert code_sandbox_problems(cfg, reward_fn=lambda *a, **k: 0.0) == []  # Python scores
    pq.write_table(pa.table({**rows, "data_source": ["hybridrl/arithmetic"] * 2}),
                   tmp_path / "d.parquet")
    assert code_sandbox_problems(cfg) == []  # no code rows: not checked


def test_a_killed_trainer_takes_its_candidates_along():
    """SIGKILL of the scoring process mid-run: the init's processes die with their parents
    (PR_SET_PDEATHSIG), the last one outside the namespace kills its pid 1 (a candidate that
    clears its own death signal included), so no candidate outlives the trainer."""
    _sandbox_or_skip()
    token = f"hybridrl-orphan-{uuid.uuid4().hex}"
    program = ("import ctypes\nctypes.CDLL(None).prctl(1, 0, 0, 0, 0)\n"  # its death signal off
               f"import subprocess, time\nsubprocess.Popen([{sandbox_python()!r}, '-c', "
               f"'import time; time.sleep(300)', '{token[:10]}' + '{token[10:]}'])\n"
               "time.sleep(300)\n")  # the token whole only in the sleeper's command line
    trainer = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom hybridrl.rewards import code\n"
         "code.run_tests(sys.argv[1], {'inputs': [''], 'outputs': ['x']}, timeout_s=120)",
         program], cwd=pathlib.Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 60
        while not _token_processes(token) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _token_processes(token), "the candidate never started"
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 20
    while _token_processes(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _token_processes(token)
    for pid in left:  # never leave them to the machine, even when the test fails
        os.kill(pid, 9)
    assert left == []
