"""Loading a ``HybridRLConfig`` from YAML files and ``key=value`` overrides.

Contract: ``load_config(yaml_paths, overrides)`` starts from the dataclass defaults, merges each
YAML file in order, then each dotlist override in order (later wins), and returns a validated,
frozen ``HybridRLConfig`` (``OmegaConf.to_object`` builds real dataclass instances, so every
``__post_init__`` runs). Every problem is a ``ValueError`` that names the full key and the source:
an unknown key (with the closest valid key, or the hybridrl key for a verl key), a value of the
wrong type, or a value a section rejects. Keys under a pass-through dict (``engine_kwargs``) are
free. ``dump_config`` writes a config back as YAML that ``load_config`` reads to an equal config.
"""

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrl.config.root import HybridRLConfig
from hybridrl.config.schema import key_kinds
from hybridrl.config.verl_keys import hybridrl_keys_for


def load_config(yaml_paths: Sequence[str] = (), overrides: Sequence[str] = ()) -> HybridRLConfig:
    """Defaults <- YAML files (in order) <- ``key=value`` overrides (in order); validated."""
    if isinstance(yaml_paths, str) or isinstance(overrides, str):
        raise TypeError("load_config takes lists: yaml_paths=[...], overrides=[...]")
    kinds = key_kinds(HybridRLConfig)
    merged = OmegaConf.structured(HybridRLConfig)
    for path in yaml_paths:
        layer = _read_yaml(str(path))
        merged = _merge(merged, layer, kinds, source=str(path))
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value "
                             "(e.g. actor.lr=1e-6)")
        if item.endswith("="):
            item += "''"  # `key=` sets the empty string (OmegaConf would read null)
        try:
            layer = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as err:
            raise ValueError(f"override {item!r} cannot be parsed: {_first_line(err)}") from None
        merged = _merge(merged, layer, kinds, source=f"override {item!r}")
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(f"{err.full_key}: {_first_line(err)}") from None


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
    layer = OmegaConf.load(path)  # OmegaConf's YAML flavour (e.g. 1e-5 is a float)
    assert isinstance(layer, DictConfig)
    return layer


def _merge(base: DictConfig, layer: DictConfig, kinds: Mapping[str, str], source: str) -> DictConfig:
    raw = _drop_empty_sections(OmegaConf.to_container(layer, resolve=False), kinds, prefix="")
    problems = list(_shape_problems(raw, kinds, prefix=""))
    if problems:
        raise ValueError(f"in {source}: " + "; ".join(problems))
    try:
        return OmegaConf.merge(base, OmegaConf.create(raw))
    except OmegaConfBaseException as err:
        raise ValueError(f"{err.full_key or '<top level>'}: {_first_line(err)} (in {source})") from None


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
    ours = hybridrl_keys_for(key)
    if ours:
        return (f"unknown key {key!r} (a verl key); in hybridrl use "
                + " and ".join(repr(k) for k in ours))
    if ours == ():
        return f"unknown key {key!r} (a verl key with no hybridrl counterpart; see docs/config.md)"
    leaves = [k for k, kind in kinds.items() if kind != "section"]
    close = difflib.get_close_matches(key, leaves, n=1, cutoff=0.6)
    if not close:  # a misspelt section name: compare against sections too
        close = difflib.get_close_matches(key, list(kinds), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "; see docs/config.md for every key"
    return f"unknown key {key!r}{hint}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
