"""Trainer section: run length, evaluation/checkpoint cadence, resume, logging, KL guard.

Contract: ``TrainerConfig`` holds what the PPO loop needs that is not a model, data or algorithm
knob. ``total_steps`` (when > 0) wins over ``total_epochs``. The KL guard (``kl_guard``) stops a
step whose measured policy KL exceeds ``max_kl`` and, with ``rollback``, restores the weights from
before that step instead of failing. ``nonfinite`` says what a NaN/inf step does (hybridrl.trainer.guards);
``collective_timeout_s`` bounds every collective. A run writes into its run folder
``run_dir`` = ``<output_dir>/<experiment_name>`` (``experiment_name`` is one folder name: no
``/``, not ``.`` or ``..``); its checkpoints go to ``resolved_checkpoint_dir``: ``checkpoint_dir``
when set, else ``<run_dir>/checkpoints``. ``overwrite`` and the run identity
(hybridrl.checkpoint.run_folder, hybridrl.checkpoint.run_identity) decide what an existing run folder means.
"""

import os
from dataclasses import dataclass

from hybridrl.config._fields import (
    check_choice,
    check_freq,
    check_non_negative,
    check_positive,
    knob,
    section,
)

RESUME_MODES = ("auto", "disable", "path")
KL_GUARD_MODES = ("step", "checkpoint")
NONFINITE_MODES = ("rollback", "skip", "fail")
LOGGERS = ("console", "jsonl", "wandb", "mlflow", "tensorboard")  # hybridrl.trainer.tracking
DEVICES = ("auto", "cpu", "cuda")


# the post-update KL forward reads one row in four by default: 15-20 % of a demo step at every
# row (issue 45), about a quarter of that sampled (docs/trainer.md)
ROW_FRACTION = 0.25


@dataclass(frozen=True)
class KLGuardConfig:
    """Guard against a policy step that moves too far from the rollout policy."""

    max_kl: float = knob(0.0, "Threshold on the step's actor/ppo_kl; 0 = guard off.")
    rollback: bool = knob(True, "Over the threshold: restore the pre-step weights and skip the "
                          "batch (True) or stop training with an error (False).")
    max_rollbacks: int = knob(3, "Consecutive rollbacks (mode step) or rollbacks of the run "
                              "(mode checkpoint) allowed before training stops.")
    mode: str = knob("step", "step (restore the state from before the step: a per-step host "
                     "copy of the optimizer shards) | checkpoint (restore the latest checkpoint "
                     "and multiply the actor and critic lr by lr_factor; no per-step copy; "
                     "saves global_step_0 when there is no checkpoint yet).")
    lr_factor: float = knob(0.5, "mode checkpoint: lr multiplier applied at each rollback "
                            "(logged as training/kl_guard_lr).")
    row_fraction: float = knob(ROW_FRACTION, "Share of each rank's rows the post-update KL "
                               "forward reads (actor/ppo_kl_final: every round(1/f)-th row; "
                               "1.0 = all). The in-update actor/ppo_kl is checked on every "
                               "row whatever this is (docs/trainer.md: cost and protection).")

    def __post_init__(self) -> None:
        check_non_negative("trainer.kl_guard.max_kl", self.max_kl)
        check_positive("trainer.kl_guard.max_rollbacks", self.max_rollbacks)
        check_choice("trainer.kl_guard.mode", self.mode, KL_GUARD_MODES)
        if not 0 < self.lr_factor <= 1:
            raise ValueError(f"trainer.kl_guard.lr_factor must be in (0, 1]; got {self.lr_factor}")
        if not 0 < self.row_fraction <= 1:  # NaN fails too
            raise ValueError("trainer.kl_guard.row_fraction must be in (0, 1]; got "
                             f"{self.row_fraction}")


@dataclass(frozen=True)
class TrainerConfig:
    """Run length, cadence, checkpoints and logging of the PPO loop."""

    total_epochs: int = knob(1, "Passes over the training prompts (used when total_steps is 0).")
    total_steps: int = knob(0, "PPO steps to run; 0 = total_epochs worth of steps.")
    save_freq: int = knob(-1, "Save a checkpoint every this many steps and after "
                             "the last one (-1 = never).")
    test_freq: int = knob(-1, "Validate every this many steps (-1 = never).")
    val_before_train: bool = knob(False, "Validate once before the first step.")
    output_dir: str = knob("outputs", "Parent of the run folders: a run writes "
                           "<output_dir>/<experiment_name>/ (run.json, config.yaml, "
                           "metrics.jsonl, generations.jsonl, plot.png, checkpoints/).")
    checkpoint_dir: str = knob("", "Folder for checkpoints (global_step_N/ subfolders); empty = "
                               "<output_dir>/<experiment_name>/checkpoints.")
    resume: str = knob("auto", "auto (latest checkpoint of this run id in the checkpoint folder "
                       "if any) | disable | path (resume_path).")
    resume_path: str = knob("", "Checkpoint folder to resume from when resume is 'path'.")
    logger: list[str] = knob(["console"], "Metric sinks: any of " + ", ".join(LOGGERS) + ".")
    project_name: str = knob("hybridrl", "Project name given to the loggers.")
    experiment_name: str = knob("default", "Run name: the run folder's name under output_dir, "
                                "and the name given to the loggers.")
    seed: int = knob(1, "Seed of model initialization and sampling.")
    device: str = knob("auto", "auto (cuda when available) | cpu | cuda.")
    kl_guard: KLGuardConfig = section(KLGuardConfig, "Rollback on excessive policy KL.")
    nonfinite: str = knob("skip", "A NaN/inf reward, advantage, loss, grad norm, KL or "
                          "parameter: skip (the optimizer refuses every non-finite update, the "
                          "weights stay finite, the step's other updates are kept; no per-step "
                          "host copy) | rollback (restore the pre-step state from a per-step "
                          "host copy of the optimizer shards, skip the batch; "
                          "kl_guard.max_rollbacks consecutive at most) | fail (stop with exit "
                          "status 1).")
    nonfinite_max_steps: int = knob(3, "With nonfinite=skip: this many consecutive non-finite "
                                    "steps are skipped, the next one fails the run (exit "
                                    "status 1); 0 = no limit.")
    overwrite: bool = knob(False, "A run that starts from step 0 where another run's files or "
                           "checkpoints are: move them into previous_<k>/ (never deleted) "
                           "instead of refusing to start.")
    max_ckpt_to_keep: int = knob(3, "Complete checkpoints kept in the checkpoint folder (the "
                                 "oldest are deleted after each save); 0 = keep all.")
    async_save: bool | str = knob("auto", "Write checkpoints in a background thread while "
                                  "training continues: auto (on when the models are on CUDA) "
                                  "| true | false.")
    collective_timeout_s: float = knob(600.0, "Timeout of every process group (seconds): a rank "
                                       "that does not reach a collective in time fails the job "
                                       "with a line naming it and its phase.")

    def __post_init__(self) -> None:
        check_positive("trainer.total_epochs", self.total_epochs)
        check_non_negative("trainer.total_steps", self.total_steps)
        check_freq("trainer.save_freq", self.save_freq)
        check_freq("trainer.test_freq", self.test_freq)
        if not self.output_dir:
            raise ValueError("trainer.output_dir must be a folder path; got ''")
        name = self.experiment_name
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            raise ValueError("trainer.experiment_name names the run folder under "
                             f"trainer.output_dir: one folder name (no '/', not '.' or '..'); "
                             f"got {name!r}")
        check_choice("trainer.resume", self.resume, RESUME_MODES)
        if (self.resume == "path") != bool(self.resume_path):
            raise ValueError("trainer.resume_path must be set exactly when trainer.resume is "
                             f"'path'; got resume={self.resume!r}, resume_path={self.resume_path!r}")
        for name in self.logger:
            check_choice("trainer.logger[]", name, LOGGERS)
        check_choice("trainer.device", self.device, DEVICES)
        check_choice("trainer.nonfinite", self.nonfinite, NONFINITE_MODES)
        check_non_negative("trainer.nonfinite_max_steps", self.nonfinite_max_steps)
        check_positive("trainer.collective_timeout_s", self.collective_timeout_s)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (
                -(2**63) <= self.seed < 2**63):  # torch seeds are 64-bit
            raise ValueError(f"trainer.seed must be an integer in [-2**63, 2**63 - 1]; got "
                             f"{self.seed!r}")
        check_non_negative("trainer.max_ckpt_to_keep", self.max_ckpt_to_keep)
        if self.async_save not in ("auto", True, False):
            raise ValueError("trainer.async_save must be auto, true or false; got "
                             f"{self.async_save!r}")

    @property
    def run_dir(self) -> str:
        """The run folder: ``<output_dir>/<experiment_name>``."""
        return os.path.join(self.output_dir, self.experiment_name)

    @property
    def resolved_checkpoint_dir(self) -> str:
        """Where ``global_step_N/`` go: ``checkpoint_dir``, else ``<run_dir>/checkpoints``."""
        return self.checkpoint_dir or os.path.join(self.run_dir, "checkpoints")
