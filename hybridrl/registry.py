"""One small name -> object registry for every pluggable piece (estimators, losses, rewards).

Contract:
- ``Registry(kind)`` maps names to objects. ``register(name)`` is a decorator and
  ``register(name, obj)`` registers directly; both return the object unchanged. Registering a
  taken name raises ``ValueError`` unless ``override=True``. ``get(name)`` raises ``ValueError``
  naming the unknown key and the registered ones.
- ``call_with_accepted_kwargs(fn, *args, **kwargs)`` calls ``fn`` with only the keyword arguments
  its signature accepts (all of them when it takes ``**kwargs``), so a user-registered function
  declares just the inputs it needs.

Registries are instances owned by the module that defines the plugged-in kind
(``hybridrl.algos.advantages.ADVANTAGE_ESTIMATORS``, ``hybridrl.algos.losses.POLICY_LOSSES``,
``hybridrl.rewards.scoring.REWARD_FNS``), never bare module-level dicts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


class Registry:
    """Name -> object table of one kind (e.g. "policy loss")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Any] = {}

    def register(self, name: str, obj: Any = None, *, override: bool = False) -> Any:
        """Register ``obj`` under ``name``; without ``obj``, a decorator that does so."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if obj is None:
            return lambda fn: self.register(name, fn, override=override)
        if not callable(obj):
            raise TypeError(f"{self.kind} {name!r} must be callable, got {type(obj).__name__}")
        if name in self._entries and not override:
            raise ValueError(
                f"{self.kind} {name!r} is already registered; pass override=True to replace it"
            )
        self._entries[name] = obj
        return obj

    def get(self, name: str) -> Any:
        """The object registered under ``name``; ValueError listing the known names otherwise."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {sorted(self._entries)}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def call_with_accepted_kwargs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn(*args, **accepted)``: only the kwargs that ``fn``'s signature names."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fn(*args, **kwargs)
    names = {p.name for p in params}
    return fn(*args, **{k: v for k, v in kwargs.items() if k in names})
