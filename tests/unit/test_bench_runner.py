"""benchmarks/run_all.py (``make bench``): the doc section it writes, without running benchmarks."""

from benchmarks.run_all import BEGIN, END, render, suite, write_doc


def _records():
    return [{"name": "reshard", "cmd": ".venv/bin/python benchmarks/reshard.py", "rc": 0,
             "wall": 12.3, "load": ("1.0/1.0/1.0", "2.0/1.0/1.0"), "out": ["ratio x = 1.10"]},
            {"name": "trl_compare", "cmd": ".venv/bin/python benchmarks/trl_compare.py", "rc": 3,
             "wall": 1.0, "load": ("0.5/0.5/0.5", "0.5/0.5/0.5"),
             "out": [f"line {i}" for i in range(30)]}]


def test_section_replaced_and_rest_of_page_kept(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\ncurated text\n")
    write_doc(doc, render(_records(), "make bench"))
    first = doc.read_text()
    assert first.startswith("# Benchmarks\n\ncurated text\n") and first.count(BEGIN) == 1
    assert "ratio x = 1.10" in first and "FAILED (exit 3)" in first
    assert "line 29" in first and "line 9" not in first  # a failure keeps its last 20 lines
    assert "load 1.0/1.0/1.0 -> 2.0/1.0/1.0" in first and "Command: `make bench`" in first
    doc.write_text(first + "\nafter the section\n")
    write_doc(doc, render(_records()[:1], "make bench BENCH_ARGS='--quick'"))
    second = doc.read_text()
    assert second.count(BEGIN) == 1 and second.count(END) == 1
    assert "FAILED" not in second and "--quick" in second
    assert "curated text" in second and second.endswith("after the section\n")


def test_suite_scripts_exist_and_quick_is_smaller():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    full, quick = dict(suite(False)), dict(suite(True))
    assert full.keys() == quick.keys() and {"reshard", "rollout_engine", "trl_compare"} <= set(full)
    for name, args in full.items():
        script = args[1].replace(".", "/") + ".py" if args[0] == "-m" else args[0]
        assert (root / script).is_file(), name
    assert full != quick
