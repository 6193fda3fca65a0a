"""The run lock over every folder a run writes (issue 43 item 5): a second run is refused when
any folder it would write is a live run's (its run folder, its trainer.checkpoint_dir) or lies
inside one, and the entrypoint refuses it before building anything."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from hybridrl.checkpoint.run_identity import StartupError
from hybridrl.checkpoint.run_lock import acquire_run_locks

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def live_runs(tmp_path):
    """Two live runs in other processes: A with its checkpoints outside its run folder, B with
    the default layout (checkpoints inside)."""
    a_run, a_ckpt = tmp_path / "out" / "a", tmp_path / "ckpt_a"
    b_run = tmp_path / "out" / "b"
    code = ("import time\nfrom hybridrl.checkpoint.run_lock import acquire_run_locks\n"
            f"a = acquire_run_locks({str(a_run)!r}, {str(a_ckpt)!r})\n"
            f"b = acquire_run_locks({str(b_run)!r}, {str(b_run / 'checkpoints')!r})\n"
            "print('held', flush=True)\ntime.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield tmp_path, a_run, a_ckpt, b_run, holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


@pytest.mark.parametrize("run,ckpt,says", [
    ("out/a", "", "the run folder"),  # the same run folder
    ("out/c", "ckpt_a", "trainer.checkpoint_dir"),  # a live run's checkpoint folder
    ("out/c", "out/b/checkpoints", "lies inside"),  # a live run's default checkpoints
    ("out/c", "out/a", "trainer.checkpoint_dir"),  # a live run's run folder as checkpoints
    ("ckpt_a/c", "", "lies inside"),  # a run folder inside a live run's checkpoints
    ("out/b/checkpoints/c", "x", "lies inside"),
])
def test_a_second_run_on_any_folder_of_a_live_run_is_refused(live_runs, run, ckpt, says):
    root, *_, pid = live_runs
    with pytest.raises(StartupError) as err:
        acquire_run_locks(root / run, root / ckpt if ckpt else "", wait_s=0.2)
    line = str(err.value)
    assert says in line and f"pid {pid}" in line and "\n" not in line, line


def test_unrelated_folders_are_free_and_no_lock_file_goes_where_runs_move_things(live_runs):
    root, a_run, a_ckpt, b_run, _ = live_runs
    locks = acquire_run_locks(root / "out" / "c", root / "ckpt_c", wait_s=0.2)
    assert sorted(lock.path.parent.name for lock in locks) == ["c", "ckpt_c"]
    for lock in locks:
        lock.release()
    # the default layout locks the run folder only: a fresh start may move checkpoints/ aside
    assert not (b_run / "checkpoints" / ".hybridrl.lock").exists()
    assert (a_ckpt / ".hybridrl.lock").exists() and (a_run / ".hybridrl.lock").exists()


def test_the_entrypoint_refuses_before_building_anything(live_runs):
    """``python -m hybridrl.train`` with trainer.checkpoint_dir on a live run's: status 2, one
    line naming the folder (absolute: resolved at start), and no trainer was built."""
    root, *_ = live_runs
    script = ("import sys\nimport hybridrl.checkpoint.run_lock as lock\n"
              "import hybridrl.trainer.ppo as ppo\nlock.LOCK_WAIT_S = 0.2\n"
              "class Built:\n    def __init__(self, *a, **k):\n"
              "        open('built', 'w').close()\n        raise RuntimeError('built')\n"
              "ppo.PPOTrainer = Built\nfrom hybridrl.train import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_PORT=str(_free_port()))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, "trainer.output_dir=out",
                           "trainer.experiment_name=c", "trainer.checkpoint_dir=ckpt_a",
                           "trainer.overwrite=true"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "trainer.checkpoint_dir" in lines[0] and f"{str(root / 'ckpt_a')!r}" in lines[0]
    assert "Traceback" not in proc.stderr and not (root / "built").exists()
    assert not (root / "out" / "c" / "run.json").exists()
    assert time.perf_counter() - t0 < 120  # seconds of start-up, no model build


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_paths_are_resolved_at_start(tmp_path, monkeypatch):
    """A reward function that changes the working directory cannot split the run folder."""
    from hybridrl.config.loader import load_config
    from hybridrl.trainer.startup import resolve_paths

    monkeypatch.chdir(tmp_path)
    cfg = resolve_paths(load_config([], ["trainer.output_dir=rel", "trainer.checkpoint_dir=ck"]))
    os.chdir("/")
    assert cfg.trainer.run_dir == str(tmp_path / "rel" / "default")
    assert cfg.trainer.resolved_checkpoint_dir == str(tmp_path / "ck")
