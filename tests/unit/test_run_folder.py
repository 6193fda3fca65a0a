"""The run folder (hybridrl.checkpoint.run_folder, hybridrl.trainer.metrics_log, trainer config): what an
existing folder means (resume, move aside, refuse), nothing hybridrl does not write is touched,
metrics and generations are appended across resumes with redone steps kept aside, a previous
config.yaml is kept. The trainer-level checks (a real run's folder, resume, overwrite, a
non-writable output_dir on 2 ranks) are in tests/distributed (test_trainer, test_failures,
test_checkpoints, test_kill_resume)."""

from __future__ import annotations

import json
import os

import pytest

from hybridrl.checkpoint.run_folder import (
    apply_run_dir,
    keep_steps_upto,
    plan_run_dir,
    run_entries,
    write_config,
)
from hybridrl.config import load_config
from hybridrl.trainer.metrics_log import MetricsLog


def _checkpoint(folder, step, run):
    path = folder / f"global_step_{step}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"run_id": run, "step": step}))
    (path / "COMPLETE").write_text("")
    return path


def _old_run(run_dir, run="aaaa", steps=(1, 2)):
    """A finished run's folder, plus a file and a folder hybridrl never writes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run, "seed": 1}))
    (run_dir / "config.yaml").write_text("old: 1\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))
    (run_dir / "generations.jsonl").write_text(json.dumps({"step": 2}) + "\n")
    (run_dir / "plot.png").write_bytes(b"png")
    (run_dir / "tensorboard").mkdir()
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / "sft").mkdir()


RUN_FILES = ["config.yaml", "generations.jsonl", "metrics.jsonl", "plot.png", "run.json",
             "tensorboard"]


def test_config_names_the_run_folder_and_the_checkpoint_folder():
    t = load_config([], ["trainer.output_dir=/o", "trainer.experiment_name=exp"]).trainer
    assert t.run_dir == "/o/exp" and t.resolved_checkpoint_dir == "/o/exp/checkpoints"
    t = load_config([], ["trainer.checkpoint_dir=/ck"]).trainer
    assert t.run_dir == "outputs/default" and t.resolved_checkpoint_dir == "/ck"
    for bad in ("a/b", "..", "."):
        with pytest.raises(ValueError, match="trainer.experiment_name names the run folder"):
            load_config([], [f"trainer.experiment_name={bad}"])
    with pytest.raises(ValueError, match="trainer.output_dir"):
        load_config([], ["trainer.output_dir="])
    # verl's default_local_dir is the checkpoint folder; the run folder is ours
    verl = load_config([], ["trainer.default_local_dir=/v/ck", "trainer.experiment_name=e"])
    assert verl.trainer.resolved_checkpoint_dir == "/v/ck" and verl.trainer.run_dir.endswith("/e")


def test_fresh_folder_and_an_earlier_start_without_checkpoint(tmp_path):
    run_dir, ckpt = tmp_path / "exp", tmp_path / "exp" / "checkpoints"
    plan = plan_run_dir(run_dir, ckpt, "auto", "", "aaaa", False)
    assert plan.error is None and plan.resume is None and not plan.move_aside
    apply_run_dir(run_dir, ckpt, plan, "aaaa", 3)
    assert json.loads((run_dir / "run.json").read_text()) == {"run_id": "aaaa", "seed": 3}
    # the same run started again with nothing to resume: its files moved aside, never deleted
    _old_run(run_dir)
    for mode in ("auto", "disable"):
        plan = plan_run_dir(run_dir, ckpt, mode, "", "aaaa", False)
        assert plan.error is None and plan.resume is None
        assert plan.move_aside == [(str(run_dir), RUN_FILES)]
    apply_run_dir(run_dir, ckpt, plan, "aaaa", 1)
    assert "no checkpoint to resume" in plan.notice and f"{run_dir}/previous_0" in plan.notice
    assert sorted(os.listdir(run_dir / "previous_0")) == RUN_FILES
    assert sorted(os.listdir(run_dir)) == ["notes.txt", "previous_0", "run.json", "sft"]
    assert (run_dir / "previous_0" / "metrics.jsonl").read_text().count("\n") == 2


def test_another_run_is_refused_unless_overwrite_which_moves_everything(tmp_path):
    run_dir, ckpt = tmp_path / "exp", tmp_path / "exp" / "checkpoints"
    _old_run(run_dir, run="aaaa")
    _checkpoint(ckpt, 2, "aaaa")
    err = plan_run_dir(run_dir, ckpt, "auto", "", "bbbb", False).error
    assert err.startswith("trainer.resume=auto:") and "aaaa" in err and "bbbb" in err
    assert "global_step_2" in err and "\n" not in err
    err = plan_run_dir(run_dir, ckpt, "disable", "", "aaaa", False).error  # its own checkpoints
    assert "already holds run aaaa's checkpoints, config.yaml" in err and "overwrite" in err
    (ckpt / "global_step_2").rename(ckpt / "old")  # no checkpoint left: still another run's
    err = plan_run_dir(run_dir, ckpt, "auto", "", "bbbb", False).error
    assert "already holds run aaaa's" in err and "trainer.experiment_name" in err
    (ckpt / "old").rename(ckpt / "global_step_2")
    plan = plan_run_dir(run_dir, ckpt, "disable", "", "bbbb", True)
    assert plan.error is None and plan.resume is None
    apply_run_dir(run_dir, ckpt, plan, "bbbb", 1)
    aside = run_dir / "previous_0"
    assert sorted(os.listdir(aside)) == sorted(["checkpoints", *RUN_FILES])
    assert os.listdir(aside / "checkpoints") == ["global_step_2"]
    assert sorted(os.listdir(run_dir)) == ["notes.txt", "previous_0", "run.json", "sft"]
    _old_run(run_dir / "x", run="cccc")  # a second overwrite: previous_1, previous_0 kept
    for name in RUN_FILES:
        os.replace(run_dir / "x" / name, run_dir / name)
    apply_run_dir(run_dir, ckpt, plan_run_dir(run_dir, ckpt, "auto", "", "dddd", True), "dddd", 1)
    assert sorted(os.listdir(run_dir / "previous_1")) == RUN_FILES
    assert sorted(os.listdir(aside)) == sorted(["checkpoints", *RUN_FILES])


def test_resume_keeps_the_folder_and_an_explicit_checkpoint_folder(tmp_path):
    run_dir, ckpt = tmp_path / "exp", tmp_path / "elsewhere"
    _old_run(run_dir, run="aaaa")
    _checkpoint(ckpt, 1, "aaaa")
    latest = _checkpoint(ckpt, 2, "aaaa")
    (ckpt / ".tmp_global_step_3").mkdir()  # a save cut short: removed at start-up
    plan = plan_run_dir(run_dir, ckpt, "auto", "", "aaaa", False)
    assert plan.resume == str(latest) and not plan.move_aside and plan.error is None
    apply_run_dir(run_dir, ckpt, plan, "aaaa", 1)
    assert sorted(os.listdir(ckpt)) == ["global_step_1", "global_step_2"]
    assert sorted(os.listdir(run_dir)) == sorted(["notes.txt", "sft", *RUN_FILES])
    # resume=path: even another run's checkpoint (a notice), the folder continues
    plan = plan_run_dir(run_dir, ckpt, "path", str(latest), "bbbb", False)
    assert plan.resume == str(latest) and "run aaaa" in plan.notice and not plan.move_aside
    assert "does not exist" in plan_run_dir(run_dir, ckpt, "path", "/nope", "a", False).error
    # overwrite: the run files into the run folder's previous_0, the checkpoints into the
    # checkpoint folder's own previous_0 (it lies outside the run folder)
    plan = plan_run_dir(run_dir, ckpt, "disable", "", "aaaa", True)
    assert plan.move_aside == [(str(run_dir), RUN_FILES),
                               (str(ckpt), ["global_step_1", "global_step_2"])]
    apply_run_dir(run_dir, ckpt, plan, "aaaa", 1)
    assert sorted(os.listdir(ckpt)) == ["previous_0"]
    assert sorted(os.listdir(ckpt / "previous_0")) == ["global_step_1", "global_step_2"]
    assert f"{ckpt}/previous_0 (2 entries)" in plan.notice


def test_checkpoints_in_the_run_folder_itself_count_as_its_files(tmp_path):
    _old_run(tmp_path, run="aaaa")
    _checkpoint(tmp_path, 1, "aaaa")
    assert "global_step_1" in run_entries(tmp_path, tmp_path)
    assert "global_step_1" not in run_entries(tmp_path, tmp_path / "checkpoints")
    (tmp_path / "ck" / ".tmp_global_step_1").mkdir(parents=True)  # a first save cut short
    assert "ck" not in run_entries(tmp_path, tmp_path / "ck")  # nothing of it to keep
    _checkpoint(tmp_path / "ck" / "deeper", 1, "aaaa")
    assert "ck" in run_entries(tmp_path, tmp_path / "ck" / "deeper")  # the folder holding them
    plan = plan_run_dir(tmp_path, tmp_path, "disable", "", "aaaa", True)
    apply_run_dir(tmp_path, tmp_path, plan, "aaaa", 1)
    assert "global_step_1" in os.listdir(tmp_path / "previous_0")


def test_keep_steps_upto_moves_later_lines_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert keep_steps_upto(path, 3) == 0 and not path.exists()
    path.write_text("".join(json.dumps({"step": s, "v": s}) + "\n" for s in (1, 2, 3, 4)))
    before = os.stat(path).st_ino
    assert keep_steps_upto(path, 4) == 0 and os.stat(path).st_ino == before  # untouched
    assert keep_steps_upto(path, 2) == 2
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    redone = tmp_path / "metrics.redone.jsonl"
    assert [json.loads(x)["step"] for x in redone.read_text().splitlines()] == [3, 4]
    assert keep_steps_upto(path, 0) == 2  # appended, never overwritten
    assert [json.loads(x)["step"] for x in redone.read_text().splitlines()] == [3, 4, 1, 2]
    assert path.read_text() == ""


def test_write_config_keeps_a_different_previous_one(tmp_path):
    assert write_config(tmp_path, "a: 1\n") is None
    assert write_config(tmp_path, "a: 1\n") is None  # the same text: nothing to keep
    kept = write_config(tmp_path, "a: 2\n")
    assert kept.startswith("config-") and (tmp_path / kept).read_text() == "a: 1\n"
    again = write_config(tmp_path, "a: 3\n")
    assert again != kept and (tmp_path / again).read_text() == "a: 2\n"
    assert (tmp_path / "config.yaml").read_text() == "a: 3\n"


def test_metrics_log_resume_appends_and_says_what_moved(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "kept": True, "x": s}) + "\n" for s in (1, 2, 3)))
    (tmp_path / "generations.jsonl").write_text(
        "".join(json.dumps({"step": s, "response": "r"}) + "\n" for s in (0, 3)))
    printed = []
    log = MetricsLog(0, tmp_path, ["console", "jsonl"],
                     print_fn=lambda *a, **k: printed.append(" ".join(map(str, a))))
    log.resume_at(2)  # resumed from global_step_2: step 3 runs again
    assert any("1 lines of steps after 2" in p and "metrics.redone.jsonl" in p for p in printed)
    assert any("generations.redone.jsonl" in p for p in printed)
    log.step(3, 3, {"x": 33.0})
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1), (2, 2), (3, 33.0)]
    gens = (tmp_path / "generations.jsonl").read_text().splitlines()
    gens = [json.loads(x)["step"] for x in gens]
    assert gens == [0]
    other = MetricsLog(1, tmp_path / "r1", ["jsonl"])  # other ranks write nothing
    other.resume_at(0)
    other.step(1, 1, {"x": 1.0})
    assert not (tmp_path / "r1").exists()
