"""Run identity: a checkpoint resumes only the run that wrote it.

Contract:
- ``run_id(cfg)`` is a 16-hex-digit hash of the resolved config (seed included) without the keys
  in ``NOT_IDENTITY`` (how long to run, where and how often to save/log, how to resume, timeouts,
  guards, the parallel layout and placement, ``parallel.placement`` and ``parallel.gen``
  included: a checkpoint resumes at another layout, and split placement at async 0 computes
  what colocated does, bit for bit): the same experiment
  continued with more steps or on other (tp, pp, dp) keeps its id, any other change (lr, data,
  model, seed, ...) makes another run. Only values that differ from the defaults are hashed: a
  knob added by a newer hybridrl (with its default) does not change the id of an older run.
- What an existing run folder or checkpoint folder means for a run id (resume, refuse, move
  aside) is ``hybridrl.checkpoint.run_folder``.
- ``StartupError`` (a ``ValueError``) marks problems found before the first step: the entrypoint
  reports them with exit status 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

NOT_IDENTITY = {"trainer": ("resume", "resume_path", "total_steps", "total_epochs", "overwrite",
                            "save_freq", "test_freq", "val_before_train", "logger", "output_dir",
                            "checkpoint_dir", "collective_timeout_s", "nonfinite", "kl_guard",
                            "nonfinite_max_steps",
                            "device", "max_ckpt_to_keep", "async_save"),
                # rollout.async_steps stays: async 1 trains on batches one step stale, so it
                # computes another run than async 0 (resume=path still crosses, with a notice)
                "parallel": ("tp", "pp", "dp", "cp", "ep", "order", "gen", "placement")}


class StartupError(ValueError):
    """A problem found before the first step (bad input, not a training failure)."""


def _non_default(data: dict, default: dict) -> dict:
    """The entries of ``data`` that differ from ``default`` (recursively, by section)."""
    out = {}
    for key, value in data.items():
        base = default.get(key)
        if isinstance(value, dict) and isinstance(base, dict):
            sub = _non_default(value, base)
            if sub:
                out[key] = sub
        elif value != base:
            out[key] = value
    return out


def run_id(cfg) -> str:
    """Hash of the resolved config without ``NOT_IDENTITY`` (see module docstring). Only the
    values that differ from the defaults count, so a newer hybridrl that adds a knob (with a
    default) still resumes the runs of an older one."""
    data = dataclasses.asdict(cfg)
    for section, keys in NOT_IDENTITY.items():
        for key in keys:
            data[section].pop(key, None)
    data = _non_default(data, dataclasses.asdict(type(cfg)()))
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
