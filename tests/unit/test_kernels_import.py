"""``import hybridrl.kernels`` is light, and a broken compiled extension is an error with its cause.

- In a fresh interpreter that has imported torch, importing hybridrl.kernels adds no
  torch._dynamo / sympy / triton / inductor module, sets or changes no environment variable and
  adds no warnings filter (it used to: a torch.compiler decorator at import loaded dynamo, sympy
  and a triton probe and set TORCHINDUCTOR_CACHE_DIR).
- ``compiled_available`` carries exactly the mark torch.compiler.assume_constant_result would
  give it (so dynamo still takes its result as a constant; test_kernels' fullgraph tests trace it).
- An extension that is installed but fails to import raises ExtensionLoadError carrying the
  import error, from ops.load(), compiled_available() and the first kernel call, unless
  HYBRIDRL_KERNELS=reference; an extension that is not built at all still falls back quietly.
  The failures are injected with an import hook in a fresh interpreter (hermetic: works whether
  or not this checkout has the extension built).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hybridrl.kernels import ops

IMPORT_PROBE = r"""
import json, os, sys, warnings
import torch
before_mods, before_env = set(sys.modules), dict(os.environ)
before_filters = list(warnings.filters)
import hybridrl.kernels
new = sorted(set(sys.modules) - before_mods)
env = {k: [before_env.get(k), os.environ.get(k)] for k in set(before_env) | set(os.environ)
       if before_env.get(k) != os.environ.get(k)}
print(json.dumps({"new": new, "env": env, "filters": len(warnings.filters) - len(before_filters),
                  "same_filters": warnings.filters[-len(before_filters):] == before_filters
                  if before_filters else True}))
"""

HEAVY = ("torch._dynamo", "sympy", "triton", "torch._inductor", "torch._functorch")


def _python(code: str, env_extra: dict | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDRL_KERNELS"}
    env.update(env_extra or {}, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_import_loads_nothing_heavy_and_changes_no_environment():
    got = json.loads(_python(IMPORT_PROBE))
    heavy = [m for m in got["new"] if m.split(".")[0] in ("sympy", "triton")
             or any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == [], heavy[:10]
    assert got["env"] == {}  # e.g. TORCHINDUCTOR_CACHE_DIR set by importing torch._dynamo
    assert got["filters"] == 0 and got["same_filters"]
    assert "hybridrl.kernels.ops" in got["new"]  # the probe did import the package


def test_compiled_available_carries_the_assume_constant_mark():
    def probe(op: str, device_type: str) -> bool:
        return False

    before = dict(vars(probe))
    torch.compiler.assume_constant_result(probe)
    mark = {k: v for k, v in vars(probe).items() if k not in before}
    assert mark  # torch still marks by an attribute; ops copies exactly that attribute
    assert {k: getattr(ops.compiled_available, k, None) for k in mark} == mark


LOAD_PROBE = r"""
import importlib.abc, importlib.util, json, os, sys
FAIL = json.loads(sys.argv[1])  # module -> [exception class name, message, ModuleNotFoundError.name]

class Empty(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass

class Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in FAIL:
            cls, msg, missing = FAIL[name]
            if cls == "Empty":  # an extension that imports (and registers nothing)
                return importlib.util.spec_from_loader(name, Empty())
            if cls == "ModuleNotFoundError":
                raise ModuleNotFoundError(msg, name=missing)
            raise {"ImportError": ImportError, "OSError": OSError}[cls](msg)
        return None

sys.meta_path.insert(0, Broken())
for mod in FAIL:
    sys.modules.pop(mod, None)
import torch
import hybridrl.kernels as K
from hybridrl.kernels import ops
out = {}
for what, call in (("load", ops.load), ("available", lambda: ops.compiled_available("gae", "cpu")),
                   ("gae", lambda: K.gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3),
                                         1.0, 1.0))):
    try:
        result = call()
        out[what] = ["ok", str(result if what != "gae" else result[0].shape)]
    except Exception as err:
        out[what] = [type(err).__name__, str(err)]
print(json.dumps(out))
"""


def _load_probe(fail: dict, env_extra: dict | None = None) -> dict:
    code = LOAD_PROBE.replace("sys.argv[1]", repr(json.dumps(fail)))
    return json.loads(_python(code, env_extra))


def test_broken_extension_is_an_error_carrying_the_cause():
    got = _load_probe({"hybridrl._C": ["ImportError", "_C.so: undefined symbol: _ZN3c10xyz", None]})
    for what in ("load", "available", "gae"):
        kind, msg = got[what]
        assert kind == "ExtensionLoadError", got
        assert "hybridrl._C is installed but failed to load" in msg
        assert "undefined symbol: _ZN3c10xyz" in msg and "\n" not in msg


def test_broken_cuda_extension_and_missing_dependency_are_errors():
    got = _load_probe({"hybridrl._C": ["ModuleNotFoundError", "No module named 'libdep'", "libdep"]})
    assert got["load"][0] == "ExtensionLoadError" and "libdep" in got["load"][1]
    got = _load_probe({"hybridrl._C": ["Empty", "", None],
                       "hybridrl._C_cuda": ["OSError", "libcudart.so.13: cannot open", None]})
    kind, msg = got["load"]
    assert kind == "ExtensionLoadError" and "hybridrl._C_cuda is installed but failed" in msg
    assert "OSError: libcudart.so.13: cannot open" in msg


def test_not_built_falls_back_and_reference_env_skips_a_broken_extension():
    got = _load_probe({"hybridrl._C": ["ModuleNotFoundError", "No module named 'hybridrl._C'",
                                       "hybridrl._C"]})
    assert got["load"] == ["ok", "False"] and got["available"] == ["ok", "False"]
    got = _load_probe({"hybridrl._C": ["ImportError", "undefined symbol: x", None]},
                      {"HYBRIDRL_KERNELS": "reference"})
    assert got["available"] == ["ok", "False"] and got["gae"][0] == "ok"


@pytest.mark.parametrize("use_compiled", ["auto", True])
def test_entrypoint_names_a_broken_extension_in_one_line(monkeypatch, use_compiled):
    """hybridrl.train's start-up check turns ExtensionLoadError into its one-line problem
    (status 2 at start), for auto as for true, instead of a traceback at the first kernel."""
    from hybridrl.kernels import ops
    from hybridrl.train import _check_kernels

    def broken(op, device_type):
        raise ops.ExtensionLoadError("hybridrl._C is built but cannot be imported: undefined "
                                     "symbol: _ZN3c10")

    monkeypatch.setattr(ops, "compiled_available", broken)
    line = _check_kernels(use_compiled, on_cuda=False)
    assert line.startswith("hybridrl._C is built but cannot be imported")
    assert "kernels.use_compiled=false" in line and "\n" not in line
