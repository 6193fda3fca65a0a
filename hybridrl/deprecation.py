"""Old import paths that keep working for one release, with a warning naming the new home.

Contract:
- ``redirect_modules(moved, removal)``: ``moved`` maps full old module names to full new ones.
  Installs one meta-path finder for that mapping (idempotent: the same mapping installs once)
  that answers only for those old names. ``import <old>`` (or ``from <old> import x``) emits one
  ``DeprecationWarning`` "<old> moved to <new>; the old path is removed in <removal>" and returns
  the module at its new path: the same module object, so ``isinstance`` checks and monkeypatches
  see one module, and its ``__spec__`` stays the new path's. Runs after the normal finders, so
  a module that still exists at the old path is never shadowed.
- ``forward_attr(owner, name, homes, removal)``: the body of a package's module ``__getattr__``
  for names that moved out of a module the package replaced: returns ``name`` from the first
  module of ``homes`` (full module names, tried in order) that defines it, with one
  ``DeprecationWarning`` naming that module, and keeps it in ``owner``'s namespace (so
  ``from owner import name``, which looks the name up twice, warns once);
  ``AttributeError`` naming ``owner`` otherwise.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Mapping, Sequence


class _Redirect(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Old module name -> the module at its new path (with a warning)."""

    def __init__(self, moved: Mapping[str, str], removal: str):
        self.moved, self.removal = dict(moved), removal
        self._specs = {}  # old name -> the new module's own spec, restored after loading

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = self.moved[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path is removed in {self.removal}",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        """The module is already executed at its new path; importlib set ``__spec__`` to the
        redirect's spec: give it back its own."""
        module.__spec__ = self._specs.pop(module.__spec__.name, module.__spec__)


def redirect_modules(moved: Mapping[str, str], removal: str) -> None:
    """Make each old module name in ``moved`` import its new module (see module docstring)."""
    if not any(isinstance(f, _Redirect) and f.moved == dict(moved) for f in sys.meta_path):
        sys.meta_path.append(_Redirect(moved, removal))


def forward_attr(owner: str, name: str, homes: Sequence[str], removal: str):
    """``name`` from its new home module, with a DeprecationWarning (see module docstring)."""
    if not name.startswith("__"):
        for home in homes:
            module = importlib.import_module(home)
            if hasattr(module, name):
                warnings.warn(f"{owner}.{name} moved to {home}.{name}; the old path is removed "
                              f"in {removal}", DeprecationWarning, stacklevel=3)
                value = getattr(module, name)
                setattr(sys.modules[owner], name, value)
                return value
    raise AttributeError(f"module {owner!r} has no attribute {name!r}")
