"""Loading a ``HybridRLConfig`` from YAML files and ``key=value`` overrides.

Contract: ``load_config(yaml_paths, overrides, *, world_size=None, notices=None)`` starts from the
dataclass defaults, merges each YAML file in order, then each override in order (later wins), and
returns a validated, frozen ``HybridRLConfig`` (``OmegaConf.to_object`` builds real dataclass
instances, so every ``__post_init__`` runs). Overrides may be verl's: they go through
``hybridrl.config.verl.translate`` first (``+key=`` accepted, verl keys translated, keys with no
meaning here refused with what to use instead); the one-line notice of what was translated is
appended to ``notices`` when given. A string (or number) where a list is expected becomes a
one-item list, null an empty list. Every bad override is reported in ONE ``ValueError`` (one line
each, in order): an unknown key (with the closest hybridrl or verl key), a refused verl key, a
value of the wrong type. Then values a section rejects raise ``ValueError`` naming the full key;
with ``world_size``, ``trainer.n_gpus_per_node * trainer.nnodes`` must equal it. Keys under a
pass-through dict (``engine_kwargs``) are free. verl's rule for the critic holds for hybridrl's
keys too: ``critic.ppo_mini_batch_size``, ``critic.ppo_epochs`` and ``critic.loss_agg_mode``
that no YAML file or override sets take the actor's (merged) value (verl's critic config reads
them with ``${oc.select:actor_rollout_ref.actor...}``). Every error is a ``ValueError`` raised
here with one line per problem and no chained OmegaConf or dataclass frames (a section's
``__post_init__`` error is re-raised as is, from this function). ``resolve_config_name(name, path)`` turns Hydra's
``--config-name``/``--config-path`` into a YAML path. ``dump_config`` writes a config back as
YAML that ``load_config`` reads to an equal config.
"""

import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf, read_write
from omegaconf.errors import OmegaConfBaseException

from hybridrl.config.root import HybridRLConfig
from hybridrl.config.schema import key_kinds
from hybridrl.config.verl.keys import VERL_BASE_CONFIGS, VERL_RULES, rule_for
from hybridrl.config.verl.translate import CRITIC_FOLLOWS_ACTOR, translate_overrides


def load_config(yaml_paths: Sequence[str] = (), overrides: Sequence[str] = (), *,
                world_size: int | None = None, notices: list[str] | None = None) -> HybridRLConfig:
    """Defaults <- YAML files (in order) <- overrides (in order, verl keys translated); validated."""
    if isinstance(yaml_paths, str) or isinstance(overrides, str):
        raise TypeError("load_config takes lists: yaml_paths=[...], overrides=[...]")
    kinds = key_kinds(HybridRLConfig)
    merged = OmegaConf.structured(HybridRLConfig)
    given: set[str] = set()  # every leaf key a file or an override sets
    for path in yaml_paths:
        layer = _read_yaml(str(path))
        merged = _merge(merged, layer, kinds, source=str(path))
        given |= _given_keys(layer)
    translation = translate_overrides(overrides)
    problems = []
    for source, item, problem in translation.steps:
        if problem:
            problems.append(problem)
            continue
        try:
            layer = _parse_item(item, source)
            merged = _merge(merged, layer, kinds, source=f"override {source!r}")
            given |= _given_keys(layer)
        except ValueError as err:
            problems.append(str(err))
    _raise_all(problems, "bad overrides")
    _critic_follows_actor(merged, given)
    error = None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        error = f"{err.full_key}: {_first_line(err)}"
    except ValueError as err:  # a section's __post_init__: re-raised here, without the frames
        error = str(err)  # of OmegaConf and the dataclass constructors it went through
    if error is not None:
        raise ValueError(error)
    _raise_all(translation.check(cfg, world_size), "problems")
    if notices is not None and translation.notice:
        notices.append(translation.notice)
    return cfg


def _given_keys(layer: DictConfig) -> set[str]:
    """The dotted leaf keys ``layer`` sets (a mapping value counts as its own key too)."""
    out: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for name, value in node.items():
                out.add(f"{prefix}{name}")
                walk(value, f"{prefix}{name}.")

    walk(OmegaConf.to_container(layer, resolve=False), "")
    return out


def _critic_follows_actor(merged: DictConfig, given: set[str]) -> None:
    """verl's rule: the critic's mini-batch size, epochs and loss aggregation are the actor's
    unless a file or an override sets them."""
    for name in CRITIC_FOLLOWS_ACTOR:
        if f"critic.{name}" not in given:
            with read_write(merged.critic):
                setattr(merged.critic, name, getattr(merged.actor, name))


def resolve_config_name(name: str, path: str = "configs") -> str | None:
    """The YAML file of Hydra's ``--config-name NAME --config-path PATH`` (``.yaml`` optional);
    None for verl's base configs (hybridrl's defaults replace them); ValueError when missing."""
    base = name[:-5] if name.endswith(".yaml") else name
    candidate = os.path.join(path, base + ".yaml")
    if os.path.isfile(candidate):
        return candidate
    if base in VERL_BASE_CONFIGS:
        return None
    raise ValueError(f"--config-name {name!r}: no file {candidate!r} (--config-path "
                     f"{path!r}); verl's base configs {' | '.join(VERL_BASE_CONFIGS)} are "
                     "accepted and mean hybridrl's defaults")


def _parse_item(item: str, source: str) -> DictConfig:
    if item.endswith("="):
        item += "''"  # `key=` sets the empty string (OmegaConf would read null)
    try:
        parsed = OmegaConf.from_dotlist([item])
    except OmegaConfBaseException as err:
        raise ValueError(f"override {source!r} cannot be parsed: {_first_line(err)}") from None
    raw = OmegaConf.to_container(parsed, resolve=False)
    fixed = _hydra_pairs(raw)
    return parsed if fixed == raw else OmegaConf.create(fixed)


def _hydra_pairs(value: Any) -> Any:
    """Hydra's ``{key:value}`` (no space after the colon) as the mapping Hydra means: YAML
    reads it as one key ``'key:value'`` with a null value."""
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        if isinstance(key, str) and item is None and ":" in key and not key.startswith(":"):
            key, _, text = key.partition(":")
            item = yaml.safe_load(text) if text.strip() else None
        out[key] = _hydra_pairs(item)
    return out


def _raise_all(problems: list[str], what: str) -> None:
    """One ValueError: the problem itself, or a count line and one line per problem."""
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(f"{len(problems)} {what}:\n" + "\n".join(f"  - {p}" for p in problems))


def dump_config(cfg: HybridRLConfig) -> str:
    """``cfg`` as YAML (every key, defaults included)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _read_yaml(path: str) -> DictConfig:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ValueError(f"config file '{path}' does not exist") from None
    except yaml.YAMLError as err:
        raise ValueError(f"config file '{path}' is not valid YAML: {_first_line(err)}") from None
    if data is None:
        return OmegaConf.create({})
    if not isinstance(data, dict):
        raise ValueError(f"config file '{path}' must hold a mapping of sections at top level; "
                         f"got {type(data).__name__}")
    try:
        layer = OmegaConf.load(path)  # OmegaConf's YAML flavour (e.g. 1e-5 is a float)
    except yaml.YAMLError as err:  # e.g. a duplicate key, which yaml.safe_load lets pass
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or _first_line(err)
        raise ValueError(f"config file '{path}': {problem}{where}") from None
    assert isinstance(layer, DictConfig)
    return layer


def _merge(base: DictConfig, layer: DictConfig, kinds: Mapping[str, str], source: str) -> DictConfig:
    raw = _drop_empty_sections(OmegaConf.to_container(layer, resolve=False), kinds, prefix="")
    raw = _one_item_lists(raw, kinds, prefix="")
    problems = list(_shape_problems(raw, kinds, prefix=""))
    if problems:
        raise ValueError(f"in {source}: " + "; ".join(problems))
    try:
        merged = OmegaConf.merge(base, OmegaConf.create(raw))
        for key in _empty_mappings(raw, kinds, prefix=""):  # `key={}` clears, merging would not
            parent, _, name = key.rpartition(".")
            node = OmegaConf.select(merged, parent) if parent else merged
            with read_write(node):  # a frozen dataclass's node is read-only
                setattr(node, name, {})
        return merged
    except OmegaConfBaseException as err:
        raise ValueError(f"{err.full_key or '<top level>'}: {_first_line(err)} (in {source})") from None


def _empty_mappings(raw: dict, kinds: Mapping[str, str], prefix: str) -> list[str]:
    """Dotted keys of mapping-valued knobs (e.g. reward.reward_fn_kwargs) given as ``{}``."""
    out = []
    for name, value in raw.items():
        key = f"{prefix}{name}"
        if kinds.get(key) == "section" and isinstance(value, dict):
            out += _empty_mappings(value, kinds, key + ".")
        elif value == {} and kinds.get(key) != "section":
            out.append(key)
    return out


def _drop_empty_sections(raw: dict, kinds: Mapping[str, str], prefix: str) -> dict:
    """``raw`` without sections left empty (``actor:`` with every line commented out)."""
    out = {}
    for name, value in raw.items():
        key = f"{prefix}{name}"
        if kinds.get(key) == "section":
            if value is None:
                continue
            if isinstance(value, dict):
                value = _drop_empty_sections(value, kinds, key + ".")
        out[name] = value
    return out


def _one_item_lists(raw: dict, kinds: Mapping[str, str], prefix: str) -> dict:
    """``raw`` with a scalar under a list key turned into ``[scalar]`` and null into ``[]``."""
    out = {}
    for name, value in raw.items():
        key = f"{prefix}{name}"
        kind = kinds.get(key)
        if kind == "section" and isinstance(value, dict):
            value = _one_item_lists(value, kinds, key + ".")
        elif kind == "list" and value is None:
            value = []
        elif kind == "list" and isinstance(value, (str, int, float)):
            value = value if _is_interpolation(value) else [value]
        out[name] = value
    return out


def _shape_problems(raw: Any, kinds: Mapping[str, str], prefix: str):
    """Messages for keys in ``raw`` (a nested dict) that the schema lacks or that are misshapen."""
    for name, value in raw.items():
        key = f"{prefix}{name}"
        kind = kinds.get(key)
        if kind is None:
            yield from (_explain_unknown(k, kinds) for k in _leaf_paths(value, key))
        elif kind == "section" and not isinstance(value, Mapping):
            yield (f"{key} is a section, not a value: set its keys instead "
                   f"(e.g. {key}.<name>=...; see docs/config.md)")
        elif kind == "section":
            yield from _shape_problems(value, kinds, key + ".")
        elif kind == "list" and not isinstance(value, list) and not _is_interpolation(value):
            yield f"{key} must be a list, e.g. {key}=[a,b] or in YAML [a, b]; got {value!r}"


def _leaf_paths(value: Any, key: str) -> list[str]:
    """``key`` itself, or the full keys of the leaves below it when ``value`` is a mapping."""
    if not isinstance(value, Mapping) or not value:
        return [key]
    return [leaf for name, sub in value.items() for leaf in _leaf_paths(sub, f"{key}.{name}")]


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${")


def _explain_unknown(key: str, kinds: Mapping[str, str]) -> str:
    rule = rule_for(key)
    if rule is not None:  # reached only for keys the translator passed on (none today)
        return f"unknown key {key!r} (a verl key: {rule.note or ', '.join(rule.ours)})"
    leaves = [k for k, kind in kinds.items() if kind != "section"]
    verl = [r.verl for r in VERL_RULES if r.kind != "refuse"]
    for name in verl:  # verl's name under hybridrl's section (actor.clip_ratio): say what it is
        if name.removeprefix("actor_rollout_ref.") == key and rule_for(name).ours:
            ours = ", ".join(repr(k) for k in rule_for(name).ours)
            return f"unknown key {key!r}; verl's {name!r} is hybridrl's {ours}"
    close = difflib.get_close_matches(key, leaves + verl, n=1, cutoff=0.6)
    if not close:  # a misspelt section name: compare against sections too
        close = difflib.get_close_matches(key, list(kinds), n=1, cutoff=0.6)
    if close and close[0] in verl and close[0] not in kinds:
        ours = rule_for(close[0]).ours
        where = f"; hybridrl: {', '.join(repr(k) for k in ours)}" if ours else ""
        return f"unknown key {key!r}; did you mean verl's {close[0]!r}{where}?"
    hint = f"; did you mean {close[0]!r}?" if close else "; see docs/config.md for every key"
    if not close and key.startswith(("actor_rollout_ref.", "critic.", "reward_model.")):
        hint = "; a verl key hybridrl does not translate (docs/from_verl.md lists those it does)"
    return f"unknown key {key!r}{hint}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
