"""scripts/bad_inputs.py stays runnable: two of its cases through the real launcher, each one line.

The whole catalogue (81 cases, ~10 min) is a script, not a test; docs/trainer.md has its last
result. Here one of its cases: an unparsable override exits 2 with one clean line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bad_inputs.py"


@pytest.mark.slow
def test_bad_input_sweep_cases_end_in_one_line():
    spec = importlib.util.spec_from_file_location("bad_inputs", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shown: list[str] = []
    results = mod.sweep(["override_bad_value"], ranks=1, progress=shown.append)
    assert [r["name"] for r in results] == ["override_bad_value"]
    assert results[0]["clean"] and results[0]["status"] == 2, shown
    assert results[0]["lines"] == ["hybridrl.train: error: override 'actor.lr=[1,': cannot be "
                                   "parsed: while parsing a flow node; did not find expected node "
                                   "content"], shown
