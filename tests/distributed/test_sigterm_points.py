"""SIGTERM at several points of hybridrl.train's start-up, first step and exit (issue 44): each
ends with the one documented line ``hybridrl.train: error: terminated (SIGTERM)`` on stderr and
status 143, never a traceback.

One process per point (``python -m hybridrl.train``: a world of one, the tiny run of
test_trainer_cases), all started at once. Every point is deterministic, no sleep decides it:
the process sends itself SIGTERM at a named point (``HYBRIDRL_TEST_SIGTERM_AT``,
``hybridrl.exits.sigterm_point``), or the test sends it once the process shows it is past a
point (its SIGTERM handler installed: ``SigCgt`` in /proc/PID/status; a line that the run's
reward function prints when step 1 calls it).
- installed: right after the handler is installed, before the process group exists;
- external: sent from here as soon as the handler is seen installed: it lands in the process
  group's set-up, the trainer's imports or the model build, wherever the process is by then;
- reward_twice: sent from here while step 1 waits for its reward function (not a reward
  error: it was reported as one before), then a second SIGTERM while the first is reported
  (hook ``reporting``: it raises nothing);
- finished: after a 1-step run, in its barrier and process-group teardown;
- exiting: past the handled region, as the process leaves (the handler writes the line).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hybridrl.testing.dist import free_port
from tests.distributed.test_trainer_cases import base_overrides, run_in

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = "hybridrl.train: error: terminated (SIGTERM)\n"
WAIT_REWARD = '''
import time
def wait(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    print("scoring", flush=True)
    time.sleep(600)
'''
# point: (hooks, total steps, extra overrides)
POINTS = {
    "installed": ("installed", 1000, []),
    "external": ("", 1000, []),
    "reward_twice": ("reporting", 1000, ["reward.reward_fn={root}/rewards.py:wait"]),
    "finished": ("finished", 1, []),
    "exiting": ("exiting", 1, []),
}


def _launch(root: str, hooks: str, steps: int, extra: list[str]) -> subprocess.Popen:
    args = [*base_overrides(root), *run_in(f"{root}/run"), f"trainer.total_steps={steps}",
            *[e.format(root=root) for e in extra]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore",
           "HYBRIDRL_TEST_SIGTERM_AT": hooks, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}  # run side by side
    return subprocess.Popen([sys.executable, "-m", "hybridrl.train", *args], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _handler_installed(pid: int) -> bool:
    """Whether the process catches SIGTERM (its handler is installed: /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (int(signal.SIGTERM) - 1) & 1)


def _send_when_installed(proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240  # a bound on a hang, not a timing: start-up is ~5 s
    while not _handler_installed(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.01)  # polling /proc, not a delay standing in for the handler
    proc.send_signal(signal.SIGTERM)


def _send_while_scoring(proc: subprocess.Popen) -> None:
    seen = ""
    while "scoring" not in seen:
        line = proc.stdout.readline()
        assert line, f"no reward call (exit status {proc.wait()}): {proc.stderr.read()[-3000:]}"
        seen += line
    proc.send_signal(signal.SIGTERM)


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """{point: (exit status, stderr)} of every point's process."""
    procs = {}
    for name, (hooks, steps, extra) in POINTS.items():
        root = str(tmp_path_factory.mktemp(name))
        with open(os.path.join(root, "rewards.py"), "w") as f:
            f.write(WAIT_REWARD)
        procs[name] = _launch(root, hooks, steps, extra)
    try:
        _send_when_installed(procs["external"])
        _send_while_scoring(procs["reward_twice"])
        out = {}
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=300)
            out[name] = (proc.returncode, err)
        return out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("point", list(POINTS))
def test_sigterm_at_a_point_is_one_line_and_status_143(ended, point):
    status, err = ended[point]
    assert (status, err) == (143, LINE), (status, err[-3000:])


LAUNCHER = '''
import os, signal, sys, time
from torch.distributed.elastic.multiprocessing.api import SignalException
import hybridrl.launch as launch
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, launch._on_signal)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
except SignalException as err:
    assert err.sigval == signal.SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)  # a second one while the first is handled
    time.sleep(60)
sys.exit(0)
'''


def test_launcher_signal_raises_once_then_exits_143():
    """hybridrl.launch's handler: torchrun's SignalException for the first SIGTERM (its agent
    stops the workers), then 143 at once for a second one, not a traceback from the except."""
    proc = subprocess.run([sys.executable, "-c", LAUNCHER], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert (proc.returncode, proc.stderr) == (143, ""), proc.stderr[-3000:]
