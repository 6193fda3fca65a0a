"""Load a script of examples/ (or scripts/) as a module, for the tests that run it."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_example(name: str, folder: str = "examples"):
    """``<repo>/<folder>/<name>.py`` imported as a fresh module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
