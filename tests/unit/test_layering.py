"""The house's layering: every import inside hybridrl runs from a higher floor to a lower one.

Reads every module's imports (top-level and inside functions) with ``ast``, maps each to its
room (the folder under ``hybridrl/``, or the top-level module) and checks the floor table of
docs/architecture.md: a room imports only rooms on lower floors (or itself). Lazy imports count:
a function-level import that runs up a floor is still a cycle in the design.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "hybridrl"

# room -> floor; a room may import rooms on strictly lower floors (docs/architecture.md)
FLOORS = {
    "registry": 0, "_C": 0, "_C_cuda": 0,
    "parallel": 1, "kernels": 1, "data": 1, "config": 1,
    "models": 2, "reshard": 2, "rewards": 2, "algos": 2,
    "planning": 3, "checkpoint": 3, "rollout": 3,
    "trainer": 4, "testing": 4,
    # the top-level modules: entrypoints and their helpers
    "exits": 5, "plot": 5, "launch": 5, "ppo": 5,
    "train": 6, "cli": 6, "sft": 7, "demo": 8, "__init__": 9,
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "hybridrl":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _room_of_file(path: pathlib.Path, pkg: pathlib.Path = PKG) -> str:
    rel = path.relative_to(pkg)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def import_edges(pkg: pathlib.Path = PKG) -> set[tuple[str, str, str]]:
    """(importing room, imported room, file) for every import of another room."""
    edges = set()
    for path in sorted(pkg.rglob("*.py")):
        src = _room_of_file(path, pkg)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_room(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "hybridrl":  # from hybridrl import _C, x
                    targets = [a.name for a in node.names]
                else:
                    targets = [_room(node.module)]
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                raise AssertionError(f"{path}: relative import; hybridrl imports absolutely")
            for dst in targets:
                if dst and dst != src:
                    edges.add((src, dst, str(path.relative_to(pkg.parent))))
    return edges


def test_every_room_has_a_floor():
    rooms = {_room_of_file(p) for p in PKG.rglob("*.py")}
    assert rooms - set(FLOORS) == set(), "a new room: give it a floor here and in docs/architecture.md"


def test_imports_only_run_down():
    up = sorted(f"{f}: {a} (floor {FLOORS[a]}) imports {b} (floor {FLOORS.get(b)})"
                for a, b, f in import_edges() if FLOORS.get(b, 99) >= FLOORS[a])
    assert up == []


def test_algos_import_no_run_machinery():
    algos = {b for a, b, _ in import_edges() if a == "algos"}
    assert algos <= {"kernels", "registry"}, algos


def test_the_check_sees_an_upward_import(tmp_path):
    # the checker itself can fail: a lazy import from algos up to the trainer is reported
    (tmp_path / "algos").mkdir()
    (tmp_path / "algos" / "x.py").write_text("def f():\n    from hybridrl.trainer.ppo import PPOTrainer\n")
    edges = import_edges(tmp_path)
    assert ("algos", "trainer", str(pathlib.Path(tmp_path.name) / "algos" / "x.py")) in edges
    with pytest.raises(AssertionError):
        (tmp_path / "algos" / "y.py").write_text("from .x import f\n")
        import_edges(tmp_path)
