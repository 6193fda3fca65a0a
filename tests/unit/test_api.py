"""`import hybridrl`: a lazy, stable surface. Importing it loads nothing heavy; every exported
name resolves to the object of its home module; docs/api.md documents every exported name."""

import importlib
import os
import re
import subprocess
import sys

import pytest

import hybridrl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_is_light():
    code = ("import sys, hybridrl; heavy = [m for m in ('torch', 'megatron.core', 'omegaconf', "
            "'sglang', 'transformer_engine') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout.strip()
    assert out == "[]"


def test_every_name_resolves_to_its_home_object():
    assert len(hybridrl.__all__) == len(set(hybridrl.__all__)) >= 40
    for module, names in hybridrl._HOME.items():
        home = importlib.import_module(module)
        for name in names:
            assert getattr(hybridrl, name) is getattr(home, name), name
    assert set(hybridrl.__all__) <= set(dir(hybridrl))


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="'nope'"):
        hybridrl.nope  # noqa: B018
    assert not hasattr(hybridrl, "_private")


def test_docs_api_lists_every_name():
    with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
        text = f.read()
    missing = [name for name in hybridrl.__all__ if not re.search(rf"`{name}[`(]", text)]
    assert missing == [], f"docs/api.md lacks {missing}"


def test_deprecated_ppo_alias_warns_and_resolves():
    import warnings

    import hybridrl.algos as algos
    import hybridrl.ppo as ppo
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ppo.compute_advantage is algos.compute_advantage
        assert ppo.POLICY_LOSSES is algos.POLICY_LOSSES
    assert [w.category for w in caught] == [DeprecationWarning] * 2
    assert "hybridrl.algos.compute_advantage" in str(caught[0].message)
    with pytest.raises(AttributeError, match="deprecated alias"):
        ppo.PPOTrainer  # noqa: B018  (moved to hybridrl.trainer.ppo, not an algos name)


def test_deprecated_ppo_submodules_redirect_with_a_warning():
    import subprocess
    code = ("import warnings, sys; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    from hybridrl.ppo.checkpointing import Checkpointer\n"
            "    import hybridrl.ppo.losses as old\n"
            "import hybridrl.checkpoint.checkpointer as c, hybridrl.algos.losses as new\n"
            "assert Checkpointer is c.Checkpointer and old is new\n"
            "print(sorted(str(x.message).split()[0] for x in w))\n"
            "import hybridrl.ppo.nope\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.stdout.strip() == "['hybridrl.ppo.checkpointing', 'hybridrl.ppo.losses']", out
    assert "No module named 'hybridrl.ppo.nope'" in out.stderr
