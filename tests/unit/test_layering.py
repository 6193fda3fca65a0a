"""The house's layering: every import inside hybridrl runs from a higher floor to a lower one.

Reads every module's imports (top-level and inside functions) with ``ast``, maps each to its
room and checks the floor table of docs/architecture.md: a room imports only rooms on lower
floors (or itself). Lazy imports count: a function-level import that runs up a floor is still a
cycle in the design.

A room is the longest key of ``FLOORS`` that prefixes a module's dotted path under ``hybridrl``:
a folder (``rollout``), a room inside a folder (``rollout.sglang``: a sub-folder; ``rollout.worker``:
a module on top of its folder's other modules) or a top-level module. A package's face
(``__init__.py``, key ``<folder>.__init__``) re-exports its rooms, so it sits above them, and an
import of the bare package name is an import of the face.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "hybridrl"

# room -> floor; a room may import rooms on strictly lower floors (docs/architecture.md)
FLOORS = {
    "registry": 0, "deprecation": 0, "_C": 0, "_C_cuda": 0,
    "parallel": 1, "kernels": 1, "data": 1,
    # config: the schema, then verl's keys and translation, the loader, the face, the reference
    "config": 1, "config.verl": 1.1, "config.loader": 1.2, "config.__init__": 1.3,
    "config.reference": 1.4,
    "models": 2, "reshard": 2, "rewards": 2, "algos": 2,
    "tools": 2.5,  # multi-turn tools: the python tool runs in the rewards' code sandbox
    "planning": 3, "checkpoint": 3,
    # rollout: protocol / batch / sampling / partition / engine_sync, the engines, the worker
    # (it picks an engine), split placement (it runs the worker's interface and an engine)
    "rollout": 3, "rollout.builtin": 3.1, "rollout.sglang": 3.1, "rollout.worker": 3.2,
    "rollout.multi_turn": 3.1,  # the agent loop: above the protocol and the tools
    "rollout.split": 3.3, "rollout.__init__": 3.4,
    "trainer": 4, "testing": 4,
    # the top-level modules: entrypoints and their helpers
    "exits": 5, "plot": 5, "launch": 5, "ppo": 5,
    "train": 6, "cli": 6, "sft": 7, "demo": 8, "__init__": 9,
}


def _lookup(dotted: str, floors: dict = FLOORS) -> str | None:
    """The longest FLOORS key that is ``dotted`` or a dotted prefix of it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in floors:
            return key
    return None


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "hybridrl":
        return None
    if len(parts) == 1:
        return "__init__"
    face = ".".join(parts[1:]) + ".__init__"  # the bare package name runs its __init__.py
    return face if face in FLOORS else _lookup(".".join(parts[1:])) or parts[1]


def _sub_room(package: str, name: str) -> str | None:
    """The room ``package.name`` is when it is one (``from hybridrl.rollout import worker``)."""
    dotted = ".".join([*package.split(".")[1:], name])
    return next((k for k in (dotted, dotted + ".__init__") if k in FLOORS), None)


def _room_of_file(path: pathlib.Path, pkg: pathlib.Path = PKG) -> str:
    rel = path.relative_to(pkg)
    if len(rel.parts) == 1:
        return rel.stem
    dotted = ".".join(rel.with_suffix("").parts)  # rollout/sglang/push.py -> rollout.sglang.push
    if rel.name == "__init__.py":
        face = ".".join(rel.parts[:-1]) + ".__init__"
        if face in FLOORS:
            return face
        dotted = ".".join(rel.parts[:-1])
    return _lookup(dotted) or rel.parts[0]


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
                elif (_room(node.module) or "").endswith(".__init__"):
                    # from hybridrl.config import x: the face, unless x is a room of its own
                    face = _room(node.module)
                    targets = [_sub_room(node.module, a.name) or face for a in node.names]
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


def test_rooms_inside_a_folder_have_floors(tmp_path):
    # the protocol may not reach up to an engine, the schema not up to verl's translation or
    # the package face, an engine not up to the worker that picks it; the reverse is allowed
    files = {
        "rollout/base.py": "def f():\n    from hybridrl.rollout.builtin.engine import BuiltinEngine\n",
        "rollout/sglang/adapter.py": "from hybridrl.rollout.worker import RolloutWorker\n",
        "rollout/worker.py": "from hybridrl.rollout.sglang.adapter import build_sglang_engine\n",
        "rollout/split/server.py": "from hybridrl.rollout import worker\n",
        "config/root.py": "from hybridrl.config.verl.keys import VERL_RULES\n",
        "config/data.py": "from hybridrl.config import load_config\n",
        "config/loader.py": "from hybridrl.config.verl.translate import translate_overrides\n",
    }
    for rel, code in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(code)
    up = {(a, b) for a, b, _ in import_edges(tmp_path) if FLOORS.get(b, 99) >= FLOORS[a]}
    assert up == {("rollout", "rollout.builtin"), ("rollout.sglang", "rollout.worker"),
                  ("config", "config.verl"), ("config", "config.__init__")}
