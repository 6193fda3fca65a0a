"""kill -9 safety (issue 15): a 2-rank torchrun job killed with SIGKILL after a checkpoint, and a
job whose last save was cut short (an incomplete ``.tmp_global_step_N`` and a half-written
``global_step_N`` left behind), both resumed with ``trainer.resume=auto``: they continue from the
newest complete checkpoint and log exactly the metrics of an uninterrupted run. The run folder's
``metrics.jsonl`` holds each step once; the lines of steps a resume ran again are kept in
``metrics.redone.jsonl``. The straight run (then the cut-short copy of it) and the killed run
are launched side by side."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed.test_trainer_cases import base_overrides, run_in

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4
NOT_COMPARED = ("timing_s/", "perf/")


def _launch(root: str, folder: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "hybridrl.train", "--config", os.path.join(REPO, "configs", "demo_cpu.yaml"),
           *base_overrides(root), "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
           *run_in(folder), f"trainer.total_steps={STEPS}",
           "trainer.save_freq=1", "trainer.resume=auto", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(run: subprocess.Popen) -> None:
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]


def _metrics(folder: str, name: str = "metrics.jsonl") -> dict[int, dict]:
    with open(os.path.join(folder, name)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert len({r["step"] for r in rows}) == len(rows), [r["step"] for r in rows]  # each once
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)}
            for r in rows}


def kill_after_step_2(root: str, folder: str, *extra: str) -> str:
    """Launch, SIGKILL the whole job once "step 2/" is printed; the output seen until then."""
    run, seen, deadline = _launch(root, folder, *extra), "", time.monotonic() + 240
    while time.monotonic() < deadline and "step 2/" not in seen:  # step 2 saved: kill the job
        seen += run.stdout.readline()
        if run.poll() is not None:
            break
    os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=60)
    return seen


def _killed_and_resumed(root: str, folder: str, *extra: str) -> str:
    """SIGKILL after step 2, then the resume to the end; the output seen before the kill."""
    seen = kill_after_step_2(root, folder, *extra)
    _finish(_launch(root, folder, *extra))
    return seen


def _cut_short(root: str, full: str, cut: str) -> None:
    """A save cut short: copy the full run's step 2 (it keeps the newest 3), leave step 3
    half-written, resume."""
    ckpt, full_ckpt = os.path.join(cut, "checkpoints"), os.path.join(full, "checkpoints")
    os.makedirs(ckpt)
    shutil.copytree(os.path.join(full_ckpt, "global_step_2"), os.path.join(ckpt, "global_step_2"))
    for name in os.listdir(full):  # run.json, config.yaml, metrics.jsonl of steps 1..4
        if name.endswith((".json", ".jsonl", ".yaml")):
            shutil.copy(os.path.join(full, name), os.path.join(cut, name))
    half = os.path.join(ckpt, ".tmp_global_step_3")
    shutil.copytree(os.path.join(full_ckpt, "global_step_3"), half)
    os.remove(os.path.join(half, "COMPLETE"))
    rank_file = os.path.join(half, "rank_00001.pt")
    with open(rank_file, "r+b") as f:
        f.truncate(os.path.getsize(rank_file) // 2)
    shutil.copytree(half, os.path.join(ckpt, "global_step_3"))  # even a renamed one: no COMPLETE
    _finish(_launch(root, cut))


def in_parallel(*chains):
    """Run the zero-argument callables side by side (each a chain of launches that depend on
    each other; the chains do not); their results in order. Launches are mostly start-up and
    waits on each other's ranks, so two chains take far less than one after the other."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(chains)) as pool:
        return [f.result() for f in [pool.submit(c) for c in chains]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("kill"))
    # one experiment name (it is part of the run id), three output folders
    full, killed, cut = (os.path.join(root, name, "run") for name in ("full", "killed", "cut"))

    def full_then_cut():
        _finish(_launch(root, full))
        _cut_short(root, full, cut)

    _, seen = in_parallel(full_then_cut, lambda: _killed_and_resumed(root, killed))
    return {"full": _metrics(full), "killed": _metrics(killed), "cut": _metrics(cut),
            "cut_redone": _metrics(cut, "metrics.redone.jsonl"), "killed_seen": seen}


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_resumes_to_the_uninterrupted_metrics(runs):
    assert "step 2/" in runs["killed_seen"]
    assert sorted(runs["full"]) == list(range(1, STEPS + 1))
    assert runs["killed"] == runs["full"]  # steps 3 and 4 re-run from global_step_2, same bits


@pytest.mark.slow
def test_a_save_cut_short_is_ignored_and_the_run_resumes_from_the_last_complete(runs):
    assert runs["cut"] == runs["full"]
    # the first start's lines of steps 3 and 4 (run again from global_step_2): kept aside
    assert runs["cut_redone"] == {s: runs["full"][s] for s in (3, 4)}
