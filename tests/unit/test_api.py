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


def _fresh_python(code: str):
    """``code`` in a new interpreter (nothing of hybridrl imported yet): CompletedProcess."""
    import subprocess

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_deprecated_ppo_submodules_redirect_with_a_warning():
    code = ("import warnings, sys; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    from hybridrl.ppo.checkpointing import Checkpointer\n"
            "    import hybridrl.ppo.losses as old\n"
            "import hybridrl.checkpoint.checkpointer as c, hybridrl.algos.losses as new\n"
            "assert Checkpointer is c.Checkpointer and old is new\n"
            "print(sorted(str(x.message).split()[0] for x in w))\n"
            "import hybridrl.ppo.nope\n")
    out = _fresh_python(code)
    assert out.stdout.strip() == "['hybridrl.ppo.checkpointing', 'hybridrl.ppo.losses']", out
    assert "No module named 'hybridrl.ppo.nope'" in out.stderr


def test_moved_rollout_and_config_modules_redirect_with_a_warning():
    # issue 36: the rollout rooms and config/verl; the old paths work one release, naming the new
    old = {"hybridrl.rollout.engine_weights": "hybridrl.rollout.builtin.weights",
           "hybridrl.rollout.sglang_push": "hybridrl.rollout.sglang.push",
           "hybridrl.rollout.sglang_layout": "hybridrl.rollout.sglang.layout",
           "hybridrl.rollout.sglang_env": "hybridrl.rollout.sglang.env",
           "hybridrl.rollout.sglang_compat": "hybridrl.rollout.sglang.compat",
           "hybridrl.rollout.remote": "hybridrl.rollout.split.remote",
           "hybridrl.rollout.gen_server": "hybridrl.rollout.split.server",
           "hybridrl.rollout.split_link": "hybridrl.rollout.split.link",
           "hybridrl.config.verl_keys": "hybridrl.config.verl.keys",
           "hybridrl.config.verl_translate": "hybridrl.config.verl.translate"}
    code = ("import importlib, sys, warnings\n"
            f"old = {old!r}\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    mods = {o: importlib.import_module(o) for o in old}\n"
            "    from hybridrl.rollout.sglang import build_sglang_engine as b1\n"
            "    from hybridrl.rollout.builtin import BuiltinEngine, EngineSpec\n"
            "    n_face = len(w)\n"
            "    from hybridrl.rollout.builtin import sample_next\n"
            "from hybridrl.rollout.sglang.adapter import build_sglang_engine as b2\n"
            "assert b1 is b2\n"
            "assert all(mods[o] is sys.modules[n] for o, n in old.items())\n"
            "assert all(sys.modules[n].__spec__.name == n for n in old.values())\n"
            "assert all(issubclass(x.category, DeprecationWarning) for x in w)\n"
            "print(n_face, len(w))\n"
            "for x in w: print(x.message)\n"
            "import hybridrl.rollout.nope\n")
    out = _fresh_python(code)
    lines = out.stdout.splitlines()
    # one warning per old module and one for the old adapter name; the builtin face's own
    # names are its stable API (no warning), a name that moved out of it warns
    assert lines[0] == f"{len(old) + 1} {len(old) + 2}", out
    for o, n in old.items():
        assert f"{o} moved to {n}; the old path is removed in 0.3" in lines, o
    assert ("hybridrl.rollout.sglang.build_sglang_engine moved to "
            "hybridrl.rollout.sglang.adapter.build_sglang_engine; the old path is removed in 0.3"
            in lines)
    assert "No module named 'hybridrl.rollout.nope'" in out.stderr


def test_docs_api_testing_example_runs(tmp_path):
    # the run_on_ranks example of docs/api.md, run as the user would run it (a script)
    import subprocess
    with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Testing your distributed code"):]
    code = section[section.index("```python\n") + 10:section.index("\n```", section.index("```python"))]
    assert "run_on_ranks(body, 2" in code
    script = tmp_path / "example.py"
    script.write_text(code + "\nif __name__ == '__main__':\n    print('example ok')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "example ok", out
