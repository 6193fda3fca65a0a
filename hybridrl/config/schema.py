"""Introspection of the config dataclasses: every key, its type, default and meaning.

Contract: ``walk(cls)`` yields one ``KeyInfo`` per key of the tree rooted at dataclass ``cls``, in
declaration order, sections before their children, with the full dotted key. ``kind`` is
``"section"`` (a nested dataclass), ``"open"`` (a dict passed through, whose sub-keys are free),
``"list"`` or ``"leaf"`` (any other value). The loader uses it to reject unknown keys and the docs generator to list them.
"""

import dataclasses
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KeyInfo:
    """One config key."""

    key: str  # full dotted key, e.g. "algorithm.kl_ctrl.target_kl"
    kind: str  # "section" | "open" | "list" | "leaf"
    type_name: str  # e.g. "float", "list[str]", "bool | str"
    default: Any  # the default value (a dataclass instance for a section)
    help: str  # meaning, from the field metadata (or the section class docstring)
    owner: type  # the dataclass that declares the field


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


def walk(cls: type, prefix: str = "") -> Iterator[KeyInfo]:
    """Every key of the dataclass tree rooted at ``cls`` (see the module docstring)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        key = f"{prefix}{field.name}"
        help_text = field.metadata.get("help", "")
        if dataclasses.is_dataclass(tp):
            yield KeyInfo(key, "section", tp.__name__, _default(field), help_text, cls)
            yield from walk(tp, key + ".")
            continue
        origin = typing.get_origin(tp)
        kind = {dict: "open", list: "list"}.get(origin, "leaf")
        yield KeyInfo(key, kind, _type_name(tp), _default(field), help_text, cls)


def key_kinds(cls: type) -> dict[str, str]:
    """Full dotted key -> kind, for every key under ``cls``."""
    return {info.key: info.kind for info in walk(cls)}
