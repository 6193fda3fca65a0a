"""Translate a verl/Hydra-style override list into hybridrl ``key=value`` overrides.

Contract: ``translate_overrides(items)`` is pure (no file system, no process group). It accepts
Hydra's ``+key=value`` / ``++key=value`` (the prefix is dropped: every hybridrl key exists), looks
each key up in ``hybridrl.config.verl.keys.VERL_RULES`` and returns a ``Translation``:

- ``steps``: one ``(source, item, problem)`` per output, in input order; ``item`` is a hybridrl
  override (None when ``problem`` says why the source was refused). Keys the table does not list
  pass through unchanged (the loader judges them: unknown keys get a did-you-mean there).
- verl's defaults that follow another key are kept: when verl's keys set the actor's
  ``ppo_mini_batch_size`` / ``ppo_epochs`` / ``loss_agg_mode`` and nothing sets the critic's,
  the critic gets the actor's value (verl's ``${oc.select:actor_rollout_ref.actor...}``).
- verl's deprecated global micro-batch sizes (``*.ppo_micro_batch_size``,
  ``*.log_prob_micro_batch_size``) become the ``*_per_gpu`` keys divided by the DP size as
  verl's megatron workers do (DP = n_gpus_per_node x nnodes / (tp x pp x cp) from verl's keys;
  ``check`` refuses the run when the loaded layout gives another DP size); giving both forms of
  one key is refused. ``critic.model.enable_gradient_checkpointing`` sets the one recompute
  knob unless the actor's key says otherwise (then refused). ``reward_model.overlong_buffer.enable
  =false`` turns the buffer off after its ``len``.
- ``notice``: one line listing what was translated or ignored (None when nothing was).
- ``check(cfg, world_size)``: the rules that need the loaded config or the world size
  (``same`` keys equal to ours, ``n_gpus_per_node * nnodes`` equal to the world); a list of
  problem lines.
Values are parsed as OmegaConf parses a dotlist value (YAML); translated values are written back
as JSON (valid YAML), untouched values keep their original text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrl.config.trainer import LOGGERS
from hybridrl.config.verl.keys import VERL_WORLD_DEFAULTS, VerlRule, rule_for

CRITIC_FOLLOWS_ACTOR = ("ppo_mini_batch_size", "ppo_epochs", "loss_agg_mode")
VERL_SINKS = ("wandb", "tensorboard", "mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio",
              "file")  # verl's trainer.logger names; those not in LOGGERS become jsonl


def parse_value(text: str) -> Any:
    """The value OmegaConf gives ``key=<text>`` (``key=`` is the empty string)."""
    if text == "":
        return ""
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]))["v"]


def split_override(item: str) -> tuple[str, str]:
    """``(key, value_text)`` of ``[+|++]key=value``; ValueError with the allowed form otherwise
    (its message does not repeat the override: the caller names it)."""
    if not isinstance(item, str):
        raise TypeError(f"override {item!r} must be a string key=value")
    if item.startswith("~"):
        raise ValueError("deleting a key (~key) has no meaning here, every key has a default; "
                         "set key=value instead")
    body = item[2:] if item.startswith("++") else item[1:] if item.startswith("+") else item
    key, sep, text = body.partition("=")
    if not sep or not key:
        raise ValueError("must look like key=value (e.g. actor.lr=1e-6)")
    return key.strip(), text


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


@dataclass
class Translation:
    """The result of ``translate_overrides`` (see the module docstring)."""

    steps: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    translated: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    same: list[tuple[str, VerlRule, Any]] = field(default_factory=list)
    world: dict[str, Any] = field(default_factory=dict)
    dp_assumed: int | None = None  # the DP size global micro-batch sizes were divided by

    @property
    def items(self) -> list[str]:
        """The hybridrl overrides, in order."""
        return [item for _, item, _ in self.steps if item is not None]

    @property
    def problems(self) -> list[str]:
        return [problem for _, _, problem in self.steps if problem]

    @property
    def notice(self) -> str | None:
        parts = []
        if self.translated:
            parts.append("verl keys translated: " + ", ".join(self.translated))
        if self.ignored:
            parts.append("accepted with no effect here: " + ", ".join(self.ignored))
        return "; ".join(parts) + " (docs/from_verl.md)" if parts else None

    def check(self, cfg: Any, world_size: int | None) -> list[str]:
        """Problems that need the loaded config or the world size."""
        out = []
        for source, rule, value in self.same:
            ours = _get(cfg, rule.ours[0])
            if value != ours:
                out.append(f"override {source!r}: {rule.note}; got {rule.ours[0]}={ours!r}")
        if self.dp_assumed is not None:
            given = {**VERL_WORLD_DEFAULTS, **self.world}
            world = world_size or given["trainer.n_gpus_per_node"] * given["trainer.nnodes"]
            par = cfg.parallel
            dp = world // (par.tp * par.pp * par.cp) if world % (par.tp * par.pp * par.cp) == 0 \
                else None
            if dp != self.dp_assumed:
                out.append(f"deprecated global micro-batch sizes were divided by DP "
                           f"{self.dp_assumed} (verl's keys) but this layout has DP {dp}; give "
                           "the *_per_gpu keys instead")
        if self.world and world_size is not None:
            given = {**VERL_WORLD_DEFAULTS, **self.world}
            n, nodes = given["trainer.n_gpus_per_node"], given["trainer.nnodes"]
            if not all(isinstance(v, int) and v > 0 for v in (n, nodes)):
                out.append(f"trainer.n_gpus_per_node ({n!r}) and trainer.nnodes ({nodes!r}) must "
                           "be positive integers")
            elif n * nodes != world_size:
                out.append(f"trainer.n_gpus_per_node*trainer.nnodes = {n}*{nodes} = {n * nodes} "
                           f"but the launcher started {world_size} ranks; hybridrl takes the "
                           "world from torchrun (--nnodes, --nproc-per-node): fix one or drop "
                           "both keys")
        return out


class _Translator:
    def __init__(self) -> None:
        self.out = Translation()
        self.emitted: dict[str, Any] = {}  # hybridrl key -> last value set (parsed)
        self.by_verl: set[str] = set()  # hybridrl keys set through a differently named verl key
        self.warmup = 0
        self.drop_overlong = False
        self.global_micro: dict[str, tuple[str, int]] = {}  # per-gpu key -> (verl key, global)
        self.ckpt: dict[str, bool] = {}  # verl gradient-checkpointing key -> value
        self.overlong_enable: bool | None = None

    def emit(self, source: str, key: str, value: Any, text: str | None = None) -> None:
        self.emitted[key] = value
        shown = text if text is not None else json.dumps(value)
        self.out.steps.append((source, f"{key}={shown}", None))

    def refuse(self, source: str, message: str) -> None:
        self.out.steps.append((source, None, f"override {source!r}: {message}"))

    def item(self, source: str) -> None:
        try:
            key, text = split_override(source)
        except ValueError as err:
            return self.refuse(source, str(err))
        try:
            value = parse_value(text)
        except ValueError as err:
            return self.refuse(source, str(err).split(": ", 1)[-1])
        except OmegaConfBaseException as err:
            return self.refuse(source, f"cannot be parsed: {str(err).splitlines()[0]}")
        except yaml.YAMLError as err:  # OmegaConf parses values as YAML: one line, not YAML's 3
            return self.refuse(source, "cannot be parsed: "
                               + "; ".join(x.strip() for x in str(err).splitlines()[:2]))
        rule = rule_for(key)
        if rule is None:
            return self.emit(source, key, value, text)
        getattr(self, f"_{rule.kind}")(source, key, text, value, rule)

    def _set(self, source, key, text, value, rule):
        mapped = dict(rule.values).get(value, value) if _hashable(value) else value
        for ours in rule.ours:
            same = ours == key and mapped == value
            self.emit(source, ours, mapped, text if mapped == value else None)
            if ours != key:
                self.by_verl.add(ours)
            if not same:
                self.out.translated.append(f"{key} -> {ours}" + (
                    f" ({value!r} -> {mapped!r})" if mapped != value else ""))

    def _ignore(self, source, key, text, value, rule):
        if rule.accept and not (_hashable(value) and value in rule.accept):
            allowed = " | ".join(repr(v) for v in rule.accept)
            return self.refuse(source, f"{key}={value!r} has no hybridrl counterpart (accepted: "
                                       f"{allowed}): {rule.note}")
        self.out.ignored.append(key)

    def _refuse(self, source, key, text, value, rule):
        self.refuse(source, f"verl key {key} has no hybridrl meaning: {rule.note}")

    def _same(self, source, key, text, value, rule):
        self.out.same.append((source, rule, value))
        self.out.ignored.append(f"{key} (= {rule.ours[0]})")

    def _world(self, source, key, text, value, rule):
        self.out.world[key] = value
        self.out.ignored.append(f"{key} (checked against the world size)")

    def _special(self, source, key, text, value, rule):
        if key.endswith("lr_warmup_steps"):
            if not isinstance(value, int) or value < -1:
                return self.refuse(source, f"{key} must be -1, 0 or a number of steps; "
                                           f"got {value!r}")
            self.warmup = max(value, 0)
            if self.warmup:
                self.emit(source, "actor.warmup_steps", value, text)
                self.out.translated.append(f"{key} -> actor.warmup_steps")
            else:
                self.out.ignored.append(f"{key}={value} (no warmup)")
        elif key == "data.filter_overlong_prompts":
            self.drop_overlong = bool(value)
        elif key.endswith("micro_batch_size"):
            if not isinstance(value, int) or value < 1:
                return self.refuse(source, f"{key} must be a positive integer; got {value!r}")
            self.global_micro[rule.ours[0]] = (key, value)
        elif key == "critic.model.enable_gradient_checkpointing":
            self.ckpt[key] = bool(value)
        elif key == "reward_model.overlong_buffer.enable":
            self.overlong_enable = bool(value)
        elif key == "trainer.logger":
            names = [value] if isinstance(value, str) else list(value or [])
            kept = list(dict.fromkeys(
                "jsonl" if n in VERL_SINKS and n not in LOGGERS else n for n in names))
            self.emit(source, "trainer.logger", kept, text if kept == names else None)
            if kept != names:
                self.out.translated.append(f"trainer.logger {names} -> {kept}")

    def _finish_global_micro(self) -> None:
        dp = _verl_dp(self.emitted, self.out.world) if self.global_micro else None
        for ours, (key, value) in self.global_micro.items():
            source = f"{key}={value}"
            if ours in self.emitted:
                self.refuse(source, f"{key} (deprecated, global) and a *_per_gpu key both set "
                                    f"{ours}; give one (verl refuses both too)")
            elif dp is None:
                self.refuse(source, "cannot divide by the DP size: trainer.n_gpus_per_node x "
                                    "trainer.nnodes is not a multiple of tp x pp x cp")
            elif value // dp < 1:
                self.refuse(source, f"{key}={value} over DP size {dp} leaves no sequence per GPU")
            else:
                self.emit(source, ours, value // dp)
                self.out.translated.append(f"{key}={value} -> {ours}={value // dp} (/ DP {dp})")
                self.out.dp_assumed = dp

    def _finish_critic_checkpointing(self) -> None:
        key = "critic.model.enable_gradient_checkpointing"
        if key not in self.ckpt:
            return
        value, mode = self.ckpt[key], "full" if self.ckpt[key] else "none"
        actor = self.emitted.get("model.recompute_granularity")
        if actor is not None and actor != mode:
            return self.refuse(f"{key}={value}", f"hybridrl has one recompute setting for every "
                                                 f"role; the actor's is {actor!r}")
        self.emit(f"{key}={value}", "model.recompute_granularity", mode)
        self.out.translated.append(f"{key} -> model.recompute_granularity ({mode!r})")

    def finish(self) -> Translation:
        tail = "(verl's default follows the actor)"
        if self.warmup and self.emitted.get("actor.lr_schedule", "constant") == "constant":
            self.emit("actor_rollout_ref.actor.optim.lr_warmup_steps", "actor.lr_schedule",
                      "warmup")
            self.out.translated.append("lr_warmup_steps > 0 -> actor.lr_schedule=warmup")
        for name in CRITIC_FOLLOWS_ACTOR:
            if f"actor.{name}" in self.by_verl and f"critic.{name}" not in self.emitted:
                self.emit(f"critic.{name} {tail}", f"critic.{name}", self.emitted[f"actor.{name}"])
                self.out.translated.append(f"critic.{name} = actor.{name} {tail}")
        self._finish_global_micro()
        self._finish_critic_checkpointing()
        if self.overlong_enable is False:
            self.emit("reward_model.overlong_buffer.enable=False", "reward.overlong_buffer", 0)
        elif self.overlong_enable and not self.emitted.get("reward.overlong_buffer"):
            self.refuse("reward_model.overlong_buffer.enable=True", "needs "
                        "reward_model.overlong_buffer.len (tokens of the buffer) > 0")
        if self.drop_overlong:
            self.emit("data.filter_overlong_prompts=True", "data.truncation", "drop")
            self.out.translated.append("data.filter_overlong_prompts=True -> data.truncation=drop")
        return self.out


def _verl_dp(emitted: dict[str, Any], world: dict[str, Any]) -> int | None:
    """verl's DP size from its own keys: n_gpus_per_node x nnodes / (tp x pp x cp)."""
    given = {**VERL_WORLD_DEFAULTS, **world}
    n, nodes = given["trainer.n_gpus_per_node"], given["trainer.nnodes"]
    if not all(isinstance(v, int) and v > 0 for v in (n, nodes)):
        return None
    model = emitted.get("parallel.tp", 1) * emitted.get("parallel.pp", 1) * emitted.get(
        "parallel.cp", 1)
    return (n * nodes) // model if model and (n * nodes) % model == 0 else None


def _hashable(value: Any) -> bool:
    return not isinstance(value, (list, dict))


def translate_overrides(items) -> Translation:
    """Translate ``items`` (see the module docstring)."""
    if isinstance(items, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    translator = _Translator()
    for item in items:
        translator.item(item)
    return translator.finish()
