"""The trainer driven from Python on 2 gloo ranks, in ONE process group (issue 42 item 4):

- examples/train_from_python.py: prompts as a list of dicts, the reward and the estimator as
  callables, built with ``hybridrl.build_trainer``: 2 steps; the callables drive every step (the
  estimator sees the whole batch at dp 2, the reward's data_source metric is there, its
  0 / 0.2 / 1 values bound the scores); every rank's torch / numpy / random global states are
  exactly what they were before the build and the steps;
- the same run with the rows written to a parquet file (``data.train_files``) gives the same
  metrics, step for step (in-memory prompts are loaded as file rows are);
- misuse, each raised on BOTH ranks as one line before any model is built (no hang): ranks
  holding different prompts; a malformed row on one rank only; a data_source no reward
  function covers; a trainer.checkpoint_dir held by another live run (a process the fixture
  starts).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridrl.testing.dist import run_on_ranks
from tests.support.examples import load_example

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _error(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _rank(rank, world, workdir):
    import hybridrl

    ex = load_example("train_from_python")
    cfg = hybridrl.load_config([], ["model.num_layers=2", "data.max_prompt_length=40",
                                    "data.train_batch_size=4", "rollout.n=2",
                                    "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
                                    "trainer.device=cpu",
                                    "algorithm.adv_estimator=grpo", "trainer.logger=[console]",
                                    f"trainer.output_dir={workdir}/misuse"])
    rows = ex.prompts(8)
    out = {"differ": _error(lambda: hybridrl.build_trainer(
        cfg, train_data=rows if rank == 0 else rows[::-1], reward_fn=ex.reward))}
    bad = [{k: v for k, v in r.items() if k != "reward_model"} for r in rows]
    out["bad_row"] = _error(lambda: hybridrl.build_trainer(
        cfg, train_data=bad if rank == 1 else rows, reward_fn=ex.reward))
    out["no_reward"] = _error(lambda: hybridrl.build_trainer(cfg, train_data=rows))
    held = dataclasses.replace(cfg, trainer=dataclasses.replace(
        cfg.trainer, checkpoint_dir=f"{workdir}/held_ckpt"))  # a live run's (the fixture's)
    out["held"] = _error(lambda: hybridrl.build_trainer(held, train_data=rows,
                                                        reward_fn=ex.reward))

    torch.manual_seed(1000 + rank)
    np.random.seed(2000 + rank)
    random.seed(3000 + rank)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    out["history"], out["calls"] = ex.main(f"{workdir}/run", steps=2)
    after = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    out["rng_kept"] = [torch.equal(before[0], after[0]), bool((before[1] == after[1]).all()),
                       before[2] == after[2]]
    out["parquet_history"] = _as_parquet(ex, hybridrl, f"{workdir}/parquet")
    return out


def _as_parquet(ex, hybridrl, workdir):
    """examples/train_from_python.py's run with its rows in a parquet file instead of memory."""
    from dataclasses import replace

    from hybridrl.data.records import rows_from_records
    from hybridrl.data.schema import write_rows

    build = hybridrl.build_trainer

    def from_file(cfg, *, train_data, **kwargs):
        path = write_rows(f"{workdir}/train.parquet", rows_from_records(train_data))
        return build(replace(cfg, data=replace(cfg.data, train_files=[path])), **kwargs)

    hybridrl.build_trainer = from_file
    try:
        return ex.main(f"{workdir}/run", steps=2)[0]
    finally:
        hybridrl.build_trainer = build


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("from_python"))
    code = ("import time\nfrom hybridrl.checkpoint.run_lock import acquire_run_locks\n"
            f"held = acquire_run_locks({workdir + '/other_run'!r}, {workdir + '/held_ckpt'!r})\n"
            "print('held', flush=True)\ntime.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)  # another live run, holding its checkpoint folder
    try:
        assert holder.stdout.readline().strip() == "held"
        out = run_on_ranks(_rank, 2, workdir, timeout=400)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    return [dict(o, holder=holder.pid) for o in out]


@pytest.mark.slow
def test_in_memory_prompts_reward_and_estimator_drive_two_ranks(results):
    for out in results:
        history, calls = out["history"], out["calls"]
        assert len(history) == 2 and calls == [(8, 4), (8, 4)]  # 4 prompts x n=2, whole batch
        for m in history:
            assert "reward/source/example/sum/mean" in m
            assert 0.0 <= m["critic/score/mean"] <= 1.0 and m["critic/score/max"] in (0.0, 0.2, 1.0)


@pytest.mark.slow
def test_in_memory_rows_train_as_the_same_rows_in_a_parquet_file(results):
    for out in results:
        for mem, file in zip(out["history"], out["parquet_history"], strict=True):
            same = {k for k in mem if not k.startswith(("timing_s/", "perf/"))}
            assert {k: mem[k] for k in same} == {k: file[k] for k in same}
            assert len(same) > 20 and "actor/pg_loss" in same


@pytest.mark.slow
def test_building_and_stepping_leave_the_callers_global_rng_as_it_was(results):
    assert [out["rng_kept"] for out in results] == [[True, True, True]] * 2


@pytest.mark.slow
def test_misuse_is_one_line_on_every_rank(results):
    differ, bad, none = ([out[k] for out in results] for k in ("differ", "bad_row", "no_reward"))
    assert differ[0] == differ[1] and differ[0].startswith(
        "ranks hold different prompts: rank 1's train_data/val_data differ from rank 0's")
    assert bad[0] == bad[1] and bad[0].startswith(
        "rank 1: train_data row 0: 'reward_model' is missing")
    assert none[0] == none[1] and none[0].startswith(
        "train_data row 0: data_source 'example/sum' (rows [0, 1, 2]) has no reward function")
    assert all("\n" not in line for line in differ + bad + none)


@pytest.mark.slow
def test_a_live_runs_checkpoint_folder_is_refused_before_any_model(results):
    """build_trainer takes the run locks as the entrypoint does: trainer.checkpoint_dir held by
    another live run is one line on both ranks (rank 0 found it), before a model is built."""
    held = [out["held"] for out in results]
    assert held[0] == held[1] and held[0].startswith("rank 0: trainer.checkpoint_dir "), held
    assert f"pid {results[0]['holder']}" in held[0] and "\n" not in held[0], held
