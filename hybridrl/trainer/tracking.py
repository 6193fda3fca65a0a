"""Experiment-tracking sinks beyond console/jsonl: wandb, mlflow, tensorboard (rank 0 only).

Contract:
- ``LOGGERS`` names every sink ``trainer.logger`` accepts; ``OPTIONAL`` maps the three optional
  ones to (import name, pip install). Each optional package is imported only when its sink is
  chosen, inside ``Tracker``.
- ``missing_loggers(names)`` (no import, ``importlib.util.find_spec``) returns one line per chosen
  sink whose package is not installed, naming the key and the pip install; the start-up checks
  run it on every rank before any collective.
- ``Tracker(names, project=, experiment=, run_dir=, config=, config_text=)`` on rank 0: writes
  ``config_text`` (the resolved config as YAML) to ``<run_dir>/config.yaml`` (a different
  previous one is kept: ``hybridrl.checkpoint.run_folder.write_config``) and opens each
  chosen sink with the config logged to it:
  wandb: ``wandb.init(project, name=experiment, dir=run_dir, config=config)`` (the mode follows
  ``WANDB_MODE``, e.g. ``offline``); mlflow: experiment ``project``, run ``experiment``, tracking
  URI ``MLFLOW_TRACKING_URI`` or ``file:<run_dir>/mlruns`` (then
  ``MLFLOW_ALLOW_FILE_STORE=true`` unless set), the flattened config as params and
  ``config.yaml`` as an artifact; tensorboard: ``torch.utils.tensorboard.SummaryWriter`` in
  ``<run_dir>/tensorboard`` with the config as text.
- ``build_tracker(cfg, rank, run_dir)``: what the trainer calls (rank 0 saves config.yaml
  even with console/jsonl only; a Tracker only when an optional sink is chosen).
- ``log(metrics, step)`` sends every finite-or-not float metric to every sink (mlflow keys with
  characters it refuses, e.g. ``@``, get ``_``); ``close()`` finishes them (idempotent).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

from hybridrl.checkpoint.run_folder import write_config
from hybridrl.config.trainer import LOGGERS  # noqa: F401  (re-exported: the accepted names)

OPTIONAL = {"wandb": ("wandb", "pip install wandb"),
            "mlflow": ("mlflow", "pip install mlflow-skinny"),
            "tensorboard": ("tensorboard", "pip install tensorboard")}
_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. /]")


def missing_loggers(names) -> list[str]:
    """One problem line per chosen optional sink whose package is missing."""
    problems = []
    for name in names:
        if name in OPTIONAL and importlib.util.find_spec(OPTIONAL[name][0]) is None:
            problems.append(f"trainer.logger '{name}' needs the {OPTIONAL[name][0]} package, "
                            f"which is not installed: {OPTIONAL[name][1]} "
                            "(or pip install 'hybridrl[tracking]')")
    return problems


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """{"a.b": "value"} of a nested dict (values as strings)."""
    out = {}
    for key, value in config.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, full + "."))
        else:
            out[full] = str(value)
    return out


class Tracker:
    """The chosen optional sinks of one run (see the module docstring)."""

    def __init__(self, names, *, project: str, experiment: str, run_dir: str | Path,
                 config: dict, config_text: str):
        problems = missing_loggers(names)
        if problems:
            raise ImportError(problems[0])
        self.run_dir = Path(run_dir)
        write_config(self.run_dir, config_text)
        self.sinks: dict = {}
        if "wandb" in names:
            import wandb

            self.sinks["wandb"] = wandb.init(project=project, name=experiment,
                                             dir=str(self.run_dir), config=config)
        if "mlflow" in names:
            self.sinks["mlflow"] = self._open_mlflow(project, experiment, config)
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            writer.add_text("config", "```\n" + config_text + "\n```", 0)
            self.sinks["tensorboard"] = writer

    def _open_mlflow(self, project: str, experiment: str, config: dict):
        import os

        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # mlflow 3 wants an explicit opt-in to its (maintained) file store
            uri = f"file:{self.run_dir.resolve() / 'mlruns'}"
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(project)
        run = mlflow.start_run(run_name=experiment)
        params = flatten(config)
        keys = sorted(params)
        for i in range(0, len(keys), 100):  # mlflow takes at most 100 params per batch
            mlflow.log_params({k: params[k][:6000] for k in keys[i:i + 100]})
        mlflow.log_artifact(str(self.run_dir / "config.yaml"))
        return run

    def log(self, metrics: dict, step: int) -> None:
        scalars = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "wandb" in self.sinks:
            self.sinks["wandb"].log(scalars, step=step)
        if "mlflow" in self.sinks:
            import mlflow

            mlflow.log_metrics({_MLFLOW_BAD.sub("_", k): v for k, v in scalars.items()
                                if math.isfinite(v)}, step=step)
        if "tensorboard" in self.sinks:
            writer = self.sinks["tensorboard"]
            for key, value in scalars.items():
                writer.add_scalar(key, value, step)
            writer.flush()

    def close(self) -> None:
        sinks, self.sinks = self.sinks, {}
        if "wandb" in sinks:
            sinks["wandb"].finish()
        if "mlflow" in sinks:
            import mlflow

            mlflow.end_run()
        if "tensorboard" in sinks:
            sinks["tensorboard"].close()


def build_tracker(cfg, rank: int, run_dir: str | Path) -> Tracker | None:
    """Rank 0: save the resolved config to ``<run_dir>/config.yaml`` and open the chosen
    optional sinks (None when there are none, and on every other rank)."""
    import dataclasses

    from hybridrl.config.loader import dump_config

    if rank != 0:
        return None
    names = [n for n in cfg.trainer.logger if n in OPTIONAL]
    text = dump_config(cfg)
    if not names:
        write_config(run_dir, text)
        return None
    t = cfg.trainer
    return Tracker(names, project=t.project_name, experiment=t.experiment_name, run_dir=run_dir,
                   config=dataclasses.asdict(cfg), config_text=text)
