"""The typed, documented surface (issue 42 item 5): docs/api.md's index is exactly
``hybridrl.__all__`` and ``hybridrl.testing.__all__`` (both directions, with each name's home
module), the body describes every indexed name, the trainer snippet is the example's code,
every public name has a docstring and type hints on its parameters, and py.typed ships."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import typing

import hybridrl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def _api_text() -> str:
    with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
        return f.read()


def _index() -> tuple[str, list[tuple[str, str, str]]]:
    """(the text before the index, [(name, import, home module)] of the index table)."""
    text = _api_text()
    head, _, index = text.partition("## Index of the public names")
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| `([^`]+)` \|$", index, flags=re.M)
    return head, rows


def test_index_is_exactly_the_exported_names_with_their_homes():
    import hybridrl.testing as testing

    _, rows = _index()
    listed = {(imp, name) for name, imp, _ in rows}
    exported = {("hybridrl", n) for n in hybridrl.__all__} | {
        ("hybridrl.testing", n) for n in testing.__all__}
    assert len(rows) == len(listed)  # no name twice
    assert sorted(listed - exported) == [] and sorted(exported - listed) == []
    for name, imp, home in rows:
        obj = getattr(importlib.import_module(imp), name)
        assert obj is getattr(importlib.import_module(home), name), (name, home)


def test_body_describes_every_indexed_name():
    head, rows = _index()
    missing = [name for name, _, _ in rows if not re.search(rf"`{re.escape(name)}[`(.]", head)]
    assert missing == []


def test_trainer_snippet_is_the_examples_main():
    head, _ = _index()
    section = head[head.index("## The trainer"):]
    start = section.index("```python\n") + len("```python\n")
    snippet = section[start:section.index("\n```", start)]
    with open(os.path.join(ROOT, "examples", "train_from_python.py"), encoding="utf-8") as f:
        example = f.read()
    assert "hybridrl.build_trainer(" in snippet and snippet in example


def _gaps(obj) -> list[str]:
    """What ``obj`` lacks: its docstring, type hints of its (or its __init__'s) parameters."""
    cls = obj if inspect.isclass(obj) else type(obj) if not callable(obj) else None
    gaps = []
    doc = vars(cls).get("__doc__") if cls is not None else obj.__doc__
    if not (doc and doc.strip()):
        gaps.append("docstring")
    if cls is not None and getattr(cls, "_is_protocol", False):
        return gaps  # a Protocol's __init__ is typing's
    fn = vars(cls).get("__init__") if inspect.isclass(obj) else obj if callable(obj) else None
    if fn is None:
        return gaps
    params = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
    gaps += [p.name for p in params if p.annotation is inspect.Parameter.empty]
    return gaps


def test_every_public_name_has_a_docstring_and_hinted_parameters():
    import hybridrl.testing as testing

    gaps = {name: _gaps(getattr(hybridrl, name)) for name in hybridrl.__all__}
    gaps.update({f"testing.{n}": _gaps(getattr(testing, n)) for n in testing.__all__})
    gaps = {name: g for name, g in gaps.items() if g}
    assert gaps == {}


def test_gap_finder_sees_missing_docstrings_and_hints():
    def bare(a, b: int):  # noqa: ANN001
        return a

    class NoDoc:
        def __init__(self, x: int) -> None:
            self.x = x

    assert _gaps(bare) == ["docstring", "a"] and _gaps(NoDoc) == ["docstring"]
    assert _gaps(hybridrl.build_trainer) == [] and _gaps(hybridrl.PPOTrainer) == []


def test_hints_of_the_python_entry_resolve():
    for obj in (hybridrl.build_trainer, hybridrl.build_layout, hybridrl.PPOTrainer.__init__,
                hybridrl.sync_engine):
        assert typing.get_type_hints(obj)


def test_py_typed_ships_as_package_data(monkeypatch):
    import setuptools

    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.setenv("HYBRIDRL_NO_EXT", "1")
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["setup.py", "--name"])
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        exec(compile(f.read(), "setup.py", "exec"), {"__name__": "__main__"})
    assert "py.typed" in captured["package_data"]["hybridrl"]
    assert os.path.isfile(os.path.join(ROOT, "hybridrl", "py.typed"))

