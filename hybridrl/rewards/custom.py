"""User reward functions given by import path, with verl's signature.

Contract. ``load_reward_fn(spec)`` resolves ``"package.module:function"`` (imported with importlib)
or ``"path/to/file.py:function"`` (loaded from that file) to a callable
``fn(data_source, solution_str, ground_truth, extra_info, **kwargs)`` returning a float or a dict
with a "score" key (other numeric keys become metrics). ``normalize_result(value, spec)`` turns
either form into ``(score, extras)``. A malformed spec, a missing module/file/function, a file that does not import (a SyntaxError
with its line, an exception at its top level) or a result of another type raises ValueError
naming the spec. ``check_call(fn, spec, kwargs)`` (at start-up) raises ValueError naming the
spec when ``fn`` cannot be called with verl's four arguments plus ``kwargs``
(``reward.reward_fn_kwargs``), instead of a TypeError on the first scored row.
``failure_line(name, err, row, data_source, index)``: the one line a failed row shows
(``reward function '<name>' raised <Type>: <message> on row R (data_source ..., index ...)``;
the ValueErrors raised here already name the function and are not wrapped again).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import numbers
import os
from collections.abc import Callable
from typing import Any


def _module_from_file(path: str, spec: str):
    name = "hybridrl_user_reward_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward function '{spec}': cannot load file {path}")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as err:  # bad input (exit 2), named like a missing import
        raise ValueError(f"reward function '{spec}': {path} line {err.lineno}: SyntaxError: "
                         f"{err.msg}") from None
    except Exception as err:  # the file's top level raised
        raise ValueError(f"reward function '{spec}': importing {path} raised "
                         f"{type(err).__name__}: {err}") from None
    return module


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """The callable named by ``"module:function"`` or ``"file.py:function"``."""
    module_name, sep, fn_name = str(spec).rpartition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(
            f"reward function '{spec}': allowed forms are 'package.module:function' "
            "or 'path/to/file.py:function'"
        )
    if module_name.endswith(".py") or os.path.sep in module_name:
        if not os.path.isfile(module_name):
            raise ValueError(f"reward function '{spec}': file {module_name} does not exist")
        module = _module_from_file(module_name, spec)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(
                f"reward function '{spec}': cannot import {module_name} ({exc})"
            ) from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward function '{spec}': {module_name} has no callable '{fn_name}'")
    return fn


def check_call(fn: Callable[..., Any], spec: str, kwargs: dict) -> None:
    """ValueError naming ``spec`` when ``fn(ds, solution, truth, extra_info, **kwargs)`` cannot bind."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without one: the call will tell
        return
    try:
        signature.bind("data_source", "solution_str", "ground_truth", {}, **kwargs)
    except TypeError as err:
        given = "".join(f", {k}=..." for k in kwargs)
        raise ValueError(f"reward function '{spec}' cannot be called as fn(data_source, "
                         f"solution_str, ground_truth, extra_info{given}) (verl's signature"
                         f"{' + reward.reward_fn_kwargs' if kwargs else ''}): {err}") from None


def failure_line(name: str, err: BaseException, row: int, data_source: str, index: Any,
                 plain: bool = False) -> str:
    """One line for a reward row that failed (see the module docstring); ``plain``: the
    message is the whole description (a timeout's)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    where = f" on row {row} (data_source {data_source!r}, index {index})"
    if isinstance(err, ValueError) and text.startswith("reward function '"):  # said it already
        return text + where
    what = text if plain else f"raised {type(err).__name__}{': ' + text if text else ''}"
    return f"reward function '{name}' {what}{where}"


def normalize_result(value: Any, spec: str) -> tuple[float, dict[str, float]]:
    """``(score, extras)`` from a float/int/bool or a dict with "score" (numeric extras kept)."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward function '{spec}' returned a dict without 'score': {value}")
        extras = {
            k: float(v) for k, v in value.items() if k != "score" and isinstance(v, numbers.Real)
        }
        return float(value["score"]), extras
    if isinstance(value, numbers.Real):
        return float(value), {}
    raise ValueError(
        f"reward function '{spec}' returned {type(value).__name__}; allowed: a number or a dict "
        "with a 'score' key"
    )
