"""Field and validation helpers shared by the config sections.

Contract:
- ``knob(default, help)`` declares a dataclass field whose meaning lives in ``metadata["help"]``;
  docs/config.md is generated from that text, so every field of every section uses it.
  Mutable defaults (lists, dicts) are copied per instance.
- ``check_*`` helpers raise ``ValueError`` whose message starts with the full dotted key
  (``"actor.clip_ratio_low"``) and states what is allowed and what was given.
"""

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any


def knob(default: Any, help: str) -> Any:
    """A dataclass field with a documented meaning; list/dict defaults get a fresh copy each time."""
    meta = {"help": help}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(factory: type, help: str) -> Any:
    """A nested sub-config field (built with its own defaults) with a documented meaning."""
    return dataclasses.field(default_factory=factory, metadata={"help": help})


def check_choice(key: str, value: Any, allowed: Iterable[Any]) -> None:
    """``value`` must be one of ``allowed``."""
    allowed = tuple(allowed)
    if value not in allowed:
        shown = " | ".join(repr(a) for a in allowed)
        raise ValueError(f"{key} must be one of {shown}; got {value!r}")


def check_positive(key: str, value: float) -> None:
    """``value`` must be > 0."""
    if not value > 0:
        raise ValueError(f"{key} must be > 0; got {value!r}")


def check_non_negative(key: str, value: float) -> None:
    """``value`` must be >= 0."""
    if not value >= 0:
        raise ValueError(f"{key} must be >= 0; got {value!r}")


def check_range(key: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    """``low <= value <= high`` (``low < value`` when ``low_open``)."""
    ok_low = value > low if low_open else value >= low
    if not (ok_low and value <= high):
        bracket = "(" if low_open else "["
        raise ValueError(f"{key} must be in {bracket}{low}, {high}]; got {value!r}")


def check_freq(key: str, value: int) -> None:
    """A step frequency: -1 (never) or a positive number of steps."""
    if value != -1 and value < 1:
        raise ValueError(f"{key} must be -1 (never) or >= 1; got {value!r}")
