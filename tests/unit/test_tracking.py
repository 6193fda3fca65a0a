"""Tracking sinks (hybridrl.trainer.tracking) offline on CPU: wandb in offline mode, mlflow with a
local file store, tensorboard event files read back; the resolved config reaches each backend
and the run directory; a chosen sink whose package is missing is one line naming the pip install.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from hybridrl.config import dump_config, load_config
from hybridrl.trainer.tracking import Tracker, missing_loggers

STEPS = [{"critic/score/mean": 0.25, "val-core/hybridrl/arithmetic/reward/mean@1": 0.5},
         {"critic/score/mean": 0.5}, {"critic/score/mean": 0.75, "actor/kl_loss": 0.125}]


def _track(name, tmp_path):
    cfg = load_config([], ["actor.lr=0.000123"])
    import dataclasses

    tracker = Tracker([name], project="proj", experiment="exp", run_dir=tmp_path,
                      config=dataclasses.asdict(cfg), config_text=dump_config(cfg))
    for step, metrics in enumerate(STEPS, start=1):
        tracker.log(metrics, step)
    tracker.close()
    assert "0.000123" in (tmp_path / "config.yaml").read_text()


def test_missing_package_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    problems = missing_loggers(["console", "jsonl", "wandb", "tensorboard"])
    assert len(problems) == 2
    assert problems[0].startswith("trainer.logger 'wandb' needs the wandb package")
    assert "pip install wandb" in problems[0] and "\n" not in problems[0]
    assert "pip install tensorboard" in problems[1]


def test_config_accepts_every_logger_and_refuses_others():
    cfg = load_config([], ["trainer.logger=[console,jsonl,wandb,mlflow,tensorboard]"])
    assert cfg.trainer.logger == ["console", "jsonl", "wandb", "mlflow", "tensorboard"]
    with pytest.raises(ValueError, match="trainer.logger"):
        load_config([], ["trainer.logger=[neptune]"])


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs the wandb package (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    _track("wandb", tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # the offline transaction log (protobuf records): keys and values are stored as text;
    # wandb's service may still be flushing it after finish(): shut it down, then wait for it
    import wandb

    wandb.teardown()
    deadline, data = time.monotonic() + 60, b""
    while b"critic/score/mean" not in data and time.monotonic() < deadline:
        time.sleep(0.5)
        data = b"".join(p.read_bytes() for p in runs[0].glob("run-*.wandb"))
    assert b"critic/score/mean" in data and b"0.75" in data and b"actor/kl_loss" in data
    assert b"0.000123" in data and b"proj" in data and b"exp" in data  # config, project, name


def test_mlflow_local_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="needs the mlflow package (pip install mlflow-skinny)")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _track("mlflow", tmp_path)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [m.value for m in client.get_metric_history(
        run.info.run_id, "val-core/hybridrl/arithmetic/reward/mean_1")] == [0.5]
    assert run.data.params["actor.lr"] == "0.000123"
    assert run.data.tags["mlflow.runName"] == "exp"


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tensorboard package "
                        "(pip install tensorboard)")
    _track("tensorboard", tmp_path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("critic/score/mean")] == [
        (1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.value for e in acc.Scalars("actor/kl_loss")] == [0.125]
    assert any("config" in tag for tag in acc.Tags()["tensors"])
