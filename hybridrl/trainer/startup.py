"""Start-up checks: run on every rank before any collective, each failure one line naming a path or key.

Contract: ``check_startup(cfg, rank, data_given=False)`` returns the list of problems (empty when the run can
start); it reads but never changes anything except creating the run folder
``<trainer.output_dir>/<trainer.experiment_name>`` (and ``trainer.checkpoint_dir`` when set, and
the synthetic data folder unless ``data_given``) and removing its own probe file. Checked:
- the run folder (``trainer.output_dir: the run folder '<path>' cannot be created or written
  (...)``), ``trainer.checkpoint_dir`` when set and ``data.synthetic.dir`` when the data is
  generated can be created and written (a folder under a regular file, no permission, ...);
- with ``rollout.engine=sglang``, ``model.path``'s config.json has no yarn
  ``rope_scaling.attention_factor`` (SGLang 0.5.21 ignores it: another model would be rolled out);
- every ``model.path``-like folder that is set exists and its ``config.json`` parses; its
  ``*.safetensors`` files are whole and their tensor shapes are config.json's (headers only,
  ``hybridrl.models.hf_files``: the line names the file and the tensor);
- the tokenizer folder (``model.tokenizer_path``, else ``model.path``) holds tokenizer files,
  and its ``tokenizer.json`` / ``tokenizer_config.json`` / ``vocab.json`` parse;
- every optional ``trainer.logger`` sink (wandb, mlflow, tensorboard) has its package installed
  (``hybridrl.trainer.tracking.missing_loggers``: one line naming the pip install);
- ``algorithm.adv_estimator`` and ``actor.policy_loss`` name registered entries (built-in or
  registered by the user's code before the run starts): ``algorithm.adv_estimator 'x' is not a
  registered advantage estimator; registered: [...]``;
- with neither ``reward.reward_fn`` nor ``reward.reward_model_path`` (nor a callable
  ``reward_fn`` given in Python), every ``data_source`` of the training/validation parquet files
  has a registered reward function (``REWARD_FNS``, or a ``reward_fn`` mapping's:
  ``known_sources(cfg, reward_fn)``), and no prompt has empty content.
``resolve_paths(cfg)``: ``cfg`` with ``trainer.output_dir``, ``checkpoint_dir`` and
``resume_path`` absolute (a reward function's later ``os.chdir`` cannot split the run folder).
``lock_run_folders(cfg)`` (rank 0): the locks over every folder the run writes
(``hybridrl.checkpoint.run_lock.acquire_run_locks``; ``StartupError``, one line, when a live run
holds one); both the entrypoint and ``hybridrl.build_trainer`` take them before any model.
``code_sandbox_problems(cfg, reward_fn=None)``: the one line when the data files have ``code``
rows for the built-in code reward and the OS sandbox cannot start here (both entries refuse).
``row_problems(rows, name, known_sources)`` runs the last check on prompt rows given in memory
(``PPOTrainer(train_data=...)``): the first row whose ``data_source`` is not in
``known_sources`` (None: no check, a reward function scores every row) and the first empty
prompt, each one line naming ``name`` and the row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _writable(key: str, folder: str, rank: int) -> str | None:
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{rank}_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        return f"{key} {folder!r} cannot be created or written ({type(err).__name__}: " \
               f"{err.strerror or err})"
    return None


def _model_folders(cfg) -> list[tuple[str, str]]:
    pairs = [("model.path", cfg.model.path), ("critic.model_path", cfg.critic.model_path),
             ("ref.model_path", cfg.ref.model_path),
             ("reward.reward_model_path", cfg.reward.reward_model_path)]
    return [(k, v) for k, v in pairs if v]


def _weight_problems(folder: str, hf_config: dict, key: str) -> list[str]:
    """Truncated safetensors files and tensors whose shape is not config.json's."""
    from hybridrl.models.hf_files import safetensors_problems
    from hybridrl.models.spec import LlamaSpec

    try:
        spec = LlamaSpec.from_hf_config(hf_config)
    except (ValueError, KeyError, TypeError):  # the model builder names what is unsupported
        return []
    return safetensors_problems(folder, spec, critic=key != "model.path")


def _sglang_rope_problems(config: Path, hf_config: dict) -> list[str]:
    """yarn's attention_factor, which SGLang 0.5.21 would silently ignore (its yarn reads
    ``attn_factor`` as a multiplier of its own mscale; transformers and hybridrl take
    ``attention_factor`` as the whole factor): the rolled-out model would differ."""
    from hybridrl.config.hf_model import parse_rope_scaling

    try:
        scaling = parse_rope_scaling(hf_config)
    except ValueError:  # the model builder names what is unsupported
        return []
    if scaling is None or scaling.attention_factor is None:
        return []
    where = next(w for w in ("rope_scaling", "rope_parameters")
                 if isinstance(hf_config.get(w), dict) and "attention_factor" in hf_config[w])
    return [f"model.path: {str(config)!r} sets {where}.attention_factor="
            f"{scaling.attention_factor}, which rollout.engine=sglang does not support: SGLang "
            "ignores attention_factor (it reads attn_factor as a multiplier of its own yarn "
            "scale), so it would generate with another model than the one trained; use "
            "rollout.engine=builtin"]


def _tokenizer_problems(tok: str, key: str) -> list[str]:
    """A tokenizer JSON file that does not parse, named."""
    out = []
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        path = Path(tok) / name
        if path.is_file():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, OSError) as err:
                out.append(f"{key}: {str(path)!r} is not valid JSON ({err})")
    return out


def _model_problems(cfg) -> list[str]:
    problems = []
    for key, folder in _model_folders(cfg):
        config = Path(folder) / "config.json"
        if not Path(folder).is_dir():
            problems.append(f"{key} {folder!r} is not a folder")
        elif config.is_file():
            try:
                hf_config = json.loads(config.read_text())
            except (ValueError, OSError) as err:
                problems.append(f"{key}: {str(config)!r} is not valid JSON ({err})")
            else:
                problems += [f"{key}: {p}" for p in _weight_problems(folder, hf_config, key)]
                if key == "model.path" and cfg.rollout.engine == "sglang":
                    problems += _sglang_rope_problems(config, hf_config)
    tok = cfg.model.tokenizer_path or cfg.model.path
    if tok and tok not in ("char", "builtin:char") and Path(tok).is_dir() and not any(
            (Path(tok) / f).is_file() for f in TOKENIZER_FILES):
        key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
        problems.append(f"{key} {tok!r} has no tokenizer files ({' / '.join(TOKENIZER_FILES)}); "
                        "set model.tokenizer_path to the folder that has them")
    elif tok and tok not in ("char", "builtin:char") and Path(tok).is_dir():
        problems += _tokenizer_problems(
            tok, "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path")
    return problems


def known_sources(cfg, reward_fn=None) -> list[str] | None:
    """The data_sources a reward function covers (``REWARD_FNS``' and a ``reward_fn`` mapping's);
    None when one function scores every row (``reward.reward_fn``, a reward model, or a
    callable ``reward_fn`` given in Python)."""
    from hybridrl.rewards.scoring import REWARD_FNS

    if callable(reward_fn) or cfg.reward.reward_fn or cfg.reward.reward_model_path:
        return None
    return [*REWARD_FNS.names(), *(reward_fn or {})]


def _data_problems(cfg, reward_fn=None) -> list[str]:
    import pyarrow.parquet as pq

    files = [*cfg.data.train_files, *cfg.data.val_files]
    known = known_sources(cfg, reward_fn)
    check_sources = known is not None
    problems = []
    for file in files:
        if not Path(file).is_file():
            problems.append(f"data file {file!r} does not exist")
            continue
        try:
            columns = pq.read_schema(file).names
            wanted = [c for c in ("data_source", cfg.data.prompt_key) if c in columns]
            table = pq.read_table(file, columns=wanted).to_pydict()
        except Exception as err:  # pyarrow's errors: not a parquet file, truncated, ...
            text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            problems.append(f"data file {file!r} cannot be read as parquet ({text})")
            continue
        sources = table.get("data_source", [])
        unknown = sorted({s for s in sources if check_sources and s not in known})
        if check_sources and unknown:
            rows = [i for i, s in enumerate(sources) if s == unknown[0]][:3]
            problems.append(f"data file {file!r}: data_source {unknown[0]!r} (rows {rows}) has "
                            f"no reward function; registered: {', '.join(sorted(known))}; "
                            "set reward.reward_fn or register one")
        for i, prompt in enumerate(table.get(cfg.data.prompt_key, [])):
            messages = prompt if isinstance(prompt, list) else [{"content": prompt}]
            if not any(str((m or {}).get("content") or "").strip() for m in messages):
                problems.append(f"data file {file!r}: row {i} has an empty prompt "
                                f"({cfg.data.prompt_key!r} column)")
                break
    return problems


def row_problems(rows, name: str, known_sources) -> list[str]:
    """Unknown data_sources and empty prompts of in-memory rows (see module docstring)."""
    problems = []
    if known_sources is not None:
        known = set(known_sources)
        bad = [i for i, r in enumerate(rows) if r.data_source not in known]
        if bad:
            problems.append(f"{name} row {bad[0]}: data_source {rows[bad[0]].data_source!r} "
                            f"(rows {bad[:3]}) has no reward function; registered: "
                            f"{', '.join(sorted(known))}; pass reward_fn or register one")
    empty = [i for i, r in enumerate(rows)
             if not any(str(m.get("content") or "").strip() for m in r.messages)]
    if empty:
        problems.append(f"{name} row {empty[0]} has an empty prompt")
    return problems


def check_startup(cfg, rank: int, *, data_given: bool = False, reward_fn=None) -> list[str]:
    """Every problem found (one line each; see module docstring). ``data_given``: the training
    prompts come from memory (``PPOTrainer(train_data=...)``): no synthetic data folder;
    ``reward_fn``: the one given in Python (``known_sources``)."""
    t = cfg.trainer
    problems = [_writable("trainer.output_dir: the run folder", t.run_dir, rank)]
    if t.checkpoint_dir:
        problems.append(_writable("trainer.checkpoint_dir", t.checkpoint_dir, rank))
    problems = [p for p in problems if p]
    if not cfg.data.train_files and cfg.data.synthetic.task != "none" and not data_given:
        problem = _writable("data.synthetic.dir", cfg.data.synthetic.dir, rank)
        problems += [problem] if problem else []
    from hybridrl.trainer.tracking import missing_loggers

    problems += missing_loggers(cfg.trainer.logger)  # no import of the sinks themselves
    return (problems + _registry_problems(cfg) + _model_problems(cfg)
            + _data_problems(cfg, reward_fn))


def _registry_problems(cfg) -> list[str]:
    """Unknown estimator / policy-loss names, found now instead of at step 1."""
    from hybridrl.algos.advantages import ADVANTAGE_ESTIMATORS
    from hybridrl.algos.losses import POLICY_LOSSES

    out = []
    for key, value, registry in (
            ("algorithm.adv_estimator", cfg.algorithm.adv_estimator, ADVANTAGE_ESTIMATORS),
            ("actor.policy_loss", cfg.actor.policy_loss, POLICY_LOSSES)):
        if value not in registry:
            out.append(f"{key} {value!r} is not a registered {registry.kind}; registered: "
                       f"{registry.names()} (register yours before the run starts)")
    return out


def resolve_paths(cfg):
    """``cfg`` with the run's folders absolute (see the module docstring)."""
    import dataclasses

    t = cfg.trainer
    fixed = {k: os.path.abspath(getattr(t, k)) for k in ("output_dir", "checkpoint_dir",
                                                         "resume_path")
             if getattr(t, k) and not os.path.isabs(getattr(t, k))}
    return dataclasses.replace(cfg, trainer=dataclasses.replace(t, **fixed)) if fixed else cfg


def lock_run_folders(cfg):
    """Rank 0: the locks over every folder the run writes (see the module docstring); keep
    them for the run's life."""
    from hybridrl.checkpoint import run_lock

    return run_lock.acquire_run_locks(cfg.trainer.run_dir, cfg.trainer.checkpoint_dir,
                                      run_lock.LOCK_WAIT_S)


def code_sandbox_problems(cfg, reward_fn=None) -> list[str]:
    """[the sandbox's one line] when the data files have ``code`` rows scored by the built-in
    code reward and the OS sandbox cannot start here (``hybridrl.rewards.sandbox``): the run
    refuses to start instead of failing at its first code row. A reward function given in
    Python, ``reward.reward_fn`` or a reward model scores instead: nothing to check."""
    if reward_fn is not None or cfg.reward.reward_fn or cfg.reward.reward_model_path:
        return []
    import pyarrow.parquet as pq

    from hybridrl.rewards import code
    from hybridrl.rewards.sandbox import SandboxUnavailable

    for file in [*cfg.data.train_files, *cfg.data.val_files]:
        try:
            if "data_source" not in pq.read_schema(file).names or "code" not in set(
                    pq.read_table(file, columns=["data_source"]).column(0).to_pylist()):
                continue
        except Exception:  # unreadable: check_startup names it
            continue
        try:
            code.default_sandbox().check()
        except SandboxUnavailable as err:
            return [f"data file {file!r} has 'code' rows but {err}"]
        return []
    return []
