"""Exit statuses and failure lines through the real launcher (issues 14, 32): every case starts
``python -m hybridrl.launch`` (torchrun's agent) on 2 ranks, and none may print a traceback.

The nine launches are independent, so one module fixture runs them side by side (three at a
time, the long waits first: a stopped rank costs ~45 s of mostly idle waiting for the collective
timeout and torchrun's grace) and each test asserts on what its launches recorded. A scenario
that broke on the way (no "step 2/" within 240 s, no worker to signal) fails its own test with
the scenario's traceback. Timings are measured from a point inside the run (its first line, the
signal), never from the launch, so load from the neighbours does not count against a bound.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
import traceback

import pytest

from tests.distributed.test_trainer_cases import base_overrides, run_in

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REWARDS = '''
import os
def key_error_on_rank1(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if os.environ.get("RANK") == "1":
        return extra_info["no_such_key"]
    return 0.0
def exit_on_rank1(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if os.environ.get("RANK") == "1":
        os._exit(0)  # the process vanishes with status 0, mid-step
    return 0.0
def hang(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    import time
    time.sleep(3600)
'''


def _launch(args, cwd):
    cmd = [sys.executable, "-m", "hybridrl.launch", "--standalone", "--nproc-per-node", "2",
           "--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_step_2(run) -> None:
    """Read the launcher's stdout until step 2 is logged (at most 240 s)."""
    deadline, seen = time.monotonic() + 240, ""
    while time.monotonic() < deadline and "step 2/" not in seen:
        seen += run.stdout.readline()
    assert "step 2/" in seen, run.stderr.read()[-2000:] if run.poll() is not None else seen


def _worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the hybridrl.train worker of ``rank`` started by the launcher."""
    for entry in os.listdir("/proc"):
        try:
            env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if int(stat[1]) == launcher_pid and f"RANK={rank}".encode() in env:
            return int(entry)
    return None


def _ended(run, timeout: float) -> dict:
    try:
        _, err = run.communicate(timeout=timeout)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
    return {"status": run.returncode, "err": err}


def _tiny(root: str, name: str, *extra: str) -> list[str]:
    return [*base_overrides(root), "algorithm.adv_estimator=grpo", "rollout.temperature=1.0",
            *run_in(f"{root}/{name}"), *extra]


def _signalled_after_step_2(root, name, sig, *extra, rank=None) -> dict:
    """A long run signalled once step 2 is logged (the whole job, or one rank's worker)."""
    run = _launch(_tiny(root, name, "trainer.total_steps=500", *extra), root)
    try:
        _wait_for_step_2(run)
        victim = run.pid if rank is None else _worker_pid(run.pid, rank)
        assert victim is not None, f"no worker of rank {rank}"
    except BaseException:
        os.killpg(run.pid, signal.SIGKILL)
        raise
    start = time.monotonic()
    (os.killpg if rank is None else os.kill)(victim, sig)
    out = _ended(run, 200)
    return {**out, "span": time.monotonic() - start}


def _stopped(root):
    return _signalled_after_step_2(root, "stopped", signal.SIGSTOP,
                                   "trainer.collective_timeout_s=10", rank=1)


def _vanished(root):
    rewards = f"reward.reward_fn={root}/rewards.py:exit_on_rank1"
    return _ended(_launch(_tiny(root, "vanished", rewards), root), 300)


def _hung(root):
    hung = _launch(_tiny(root, "hang", f"reward.reward_fn={root}/rewards.py:hang",
                         "reward.timeout_s=2", "reward.num_workers=1"), root)
    hung.stdout.readline()  # rank 0's 'hybridrl: world ...' line: the run is up
    start = time.monotonic()  # from there: the launch's start-up varies with load
    out = _ended(hung, 300)
    return {**out, "span": time.monotonic() - start}


def _held(root):
    """A second run on a run folder in use, then SIGTERM of the first."""
    first = _launch(_tiny(root, "held", "trainer.total_steps=500"), root)
    try:
        _wait_for_step_2(first)
        second = _ended(_launch(_tiny(root, "held", "trainer.total_steps=500"), root), 300)
        os.killpg(first.pid, signal.SIGTERM)
    except BaseException:
        os.killpg(first.pid, signal.SIGKILL)
        raise
    return {"second": second, "first": _ended(first, 120)}


def _killed(root):
    return _signalled_after_step_2(root, "killed", signal.SIGKILL, rank=1)


def _interrupted(root):
    return _signalled_after_step_2(root, "int", signal.SIGINT)


def _user_error(root):
    rewards = f"reward.reward_fn={root}/rewards.py:key_error_on_rank1"
    return _ended(_launch(_tiny(root, "user", rewards), root), 300)


def _bad_config(root):
    return _ended(_launch(["actor.lr=-1"], root), 300)


SCENARIOS = (_stopped, _vanished, _hung, _held, _killed, _interrupted, _user_error, _bad_config)


def _run(scenario, root):
    try:
        return scenario(root)
    except BaseException:
        return {"broke": traceback.format_exc()}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("launcher")
    (root / "rewards.py").write_text(REWARDS)
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {s.__name__.strip("_"): pool.submit(_run, s, str(root)) for s in SCENARIOS}
        out = {name: f.result() for name, f in futures.items()}
    return str(root), out


def _got(launches, name) -> dict:
    out = launches[1][name]
    if "broke" in out:
        pytest.fail(f"scenario {name} broke:\n{out['broke']}")
    return out


def _error_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("hybridrl.train: error")]


@pytest.mark.slow
def test_launcher_exit_statuses(launches):
    """bad config -> 2; a user-code error only rank 1 hits -> 1, one line; Ctrl-C -> 130.
    None of them prints a traceback (torchrun's or ours)."""
    bad = _got(launches, "bad_config")
    assert bad["status"] == 2 and bad["err"].count("hybridrl.train: error") == 1, bad["err"][-2000:]
    user = _got(launches, "user_error")
    err = user["err"]
    assert user["status"] == 1, err[-3000:]
    lines = _error_lines(err)
    # the reward error of rank 1 reaches every rank (rewards.distributed): shown once
    assert len(lines) == 1 and "reward function" in lines[0], err[-3000:]
    assert "raised KeyError: 'no_such_key' on row " in lines[0] and "(data_source 'hy" in lines[0]
    assert "Traceback" not in err
    stopped = _got(launches, "interrupted")
    assert stopped["status"] == 130, stopped["err"][-3000:]
    assert "Traceback" not in stopped["err"]


@pytest.mark.slow
def test_launcher_reward_timeout_run_lock_and_sigterm(launches):
    """Issue 32: a hanging reward function (in a worker pool) fails at reward.timeout_s with one
    line naming it and the row, not a collective timeout; a second run on a run folder in use
    is refused naming the holder; SIGTERM is one line and status 143, no traceback."""
    root = launches[0]
    hung = _got(launches, "hung")
    lines = _error_lines(hung["err"])
    assert hung["status"] == 1 and len(lines) == 1, hung["err"][-3000:]
    assert f"reward function '{root}/rewards.py:hang' no result within 2 s (reward.timeout_s) " \
           "on row " in lines[0] and "collective" not in lines[0], lines
    # step 1 up to the 2 s reward timeout, the report and the teardown: seconds quiet, so 200 s
    # is out of load's reach and still 400 s short of the 600 s collective timeout
    assert hung["span"] < 200
    held = _got(launches, "held")
    second, first = held["second"], held["first"]
    lines = _error_lines(second["err"])
    assert second["status"] == 2 and len(lines) == 1, second["err"][-3000:]
    assert "is in use by another run (host " in lines[0] and ", pid " in lines[0], lines
    assert first["status"] == 143, first["err"][-3000:]
    assert "terminated (SIGTERM)" in first["err"] and "Traceback" not in first["err"]


@pytest.mark.slow
def test_launcher_names_a_killed_rank_once(launches):
    """Issue 32 item 7: kill -9 of rank 1 mid-run: one line naming rank 1 (was gloo's raw
    "Connection closed by peer", not naming it), status 1, no traceback."""
    killed = _got(launches, "killed")
    lines = _error_lines(killed["err"])
    assert killed["status"] == 1 and len(lines) == 1, killed["err"][-3000:]
    assert "a rank's process is gone" in lines[0] and "rank 1 has sent no heartbeat" in lines[0]
    assert "Traceback" not in killed["err"], killed["err"][-3000:]


@pytest.mark.slow
def test_launcher_names_a_stopped_rank_and_a_vanished_one_once(launches):
    """Issue 32 items 6 and 7: ``os._exit(0)`` inside a reward function on rank 1 (status 0, no
    error of its own), and a SIGSTOPped rank 1 (alive, silent): each is one line naming rank 1,
    shown once, status 1, no traceback, well before the default 600 s collective timeout."""
    gone = _got(launches, "vanished")
    lines = _error_lines(gone["err"])
    assert gone["status"] == 1 and len(lines) == 1, gone["err"][-3000:]
    assert "rank 1" in lines[0] and "heartbeat" in lines[0], lines
    assert "Traceback" not in gone["err"], gone["err"][-3000:]
    stopped = _got(launches, "stopped")
    lines = _error_lines(stopped["err"])
    assert stopped["status"] == 1 and len(lines) == 1, stopped["err"][-3000:]
    assert "rank 1 stopped responding (no heartbeat for" in lines[0], lines
    assert "Traceback" not in stopped["err"], stopped["err"][-3000:]
    # the 10 s collective_timeout_s, staleness and torchrun's 30 s grace for the stopped rank
    # (~45 s quiet; the launch is not in the span): 180 s leaves load 4x, far from 600 s
    assert stopped["span"] < 180
