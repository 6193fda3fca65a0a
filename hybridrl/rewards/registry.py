"""A small name -> object registry (reward functions here; usable for any pluggable component).

Contract. ``Registry(kind)`` maps names to objects. ``register(name, obj)`` adds one (or, called
with only a name, returns a decorator); a name registered twice raises ValueError unless
``override=True``. ``get(name)`` returns the object or raises ValueError naming the unknown name
and listing the registered ones. Registries are instances, never module-level dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Registry:
    """Named objects of one kind (e.g. "reward function")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Any] = {}

    def register(self, name: str, obj: Any = None, override: bool = False) -> Any:
        if obj is None:

            def decorator(fn: Callable) -> Callable:
                self.register(name, fn, override)
                return fn

            return decorator
        if name in self._items and not override:
            raise ValueError(f"{self.kind} '{name}' is already registered; pass override=True")
        self._items[name] = obj
        return obj

    def get(self, name: str) -> Any:
        if name not in self._items:
            raise ValueError(f"unknown {self.kind} '{name}'; registered: {sorted(self._items)}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
