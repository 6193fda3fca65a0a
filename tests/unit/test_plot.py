"""``hybridrl plot [RUN_DIR]`` (hybridrl.plot): a PNG from a run folder's metrics.jsonl (default
RUN_DIR: the default run folder, outputs/default); bad input is one line."""

from __future__ import annotations

import json

import pytest

from hybridrl.cli import main
from hybridrl.plot import PANELS, plot_run


def _run_dir(tmp_path, rows):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


ROWS = [{"step": s, "kept": s != 3, "critic/score/mean": 0.1 * s, "actor/kl_loss": 0.01 * s,
         "actor/entropy": 1.0 / s, "response_length/mean": 7.0, "timing_s/step": 2.0,
         **({"val/score/mean": 0.2 * s} if s % 2 == 0 else {})} for s in range(1, 7)]


def test_plot_writes_a_png_and_the_cli_prints_its_path(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="needs the matplotlib package "
                        "(pip install matplotlib)")
    run = _run_dir(tmp_path, ROWS)
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"step": 10, "val/score/mean": 0.1}) + "\n")
    out = plot_run(run, sft_metrics=sft)
    assert out == str(run / "plot.png")
    data = (run / "plot.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert main(["plot", str(run), "--out", str(tmp_path / "x.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "x.png")
    assert [title for title, _ in PANELS] == ["score", "KL", "entropy", "response length",
                                              "seconds per step"]


def test_missing_or_empty_metrics_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl" in err and str(tmp_path) in err
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        plot_run(tmp_path)


def test_without_run_dir_the_default_run_folder_is_plotted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plot"]) == 2  # nothing there yet: one line naming the default run folder
    assert "outputs/default/metrics.jsonl" in capsys.readouterr().err
    pytest.importorskip("matplotlib", reason="needs the matplotlib package "
                        "(pip install matplotlib)")
    (tmp_path / "outputs" / "default").mkdir(parents=True)
    _run_dir(tmp_path / "outputs" / "default", ROWS)
    assert main(["plot"]) == 0
    assert capsys.readouterr().out.strip() == "outputs/default/plot.png"
    assert (tmp_path / "outputs" / "default" / "plot.png").stat().st_size > 20_000
