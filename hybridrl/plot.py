"""``hybridrl plot [RUN_DIR]``: one PNG of a run's curves from its ``metrics.jsonl``.

Contract: ``plot_run(run_dir, out=None, sft_metrics=None)`` reads ``<run_dir>/metrics.jsonl``
(``run_dir``: a run folder, ``<trainer.output_dir>/<trainer.experiment_name>``)
(one JSON object per step, as the trainer writes it; rolled-back steps, ``"kept": false``, are
drawn as crosses) and writes ``out`` (default ``<run_dir>/plot.png``) with one panel per
``PANELS`` entry: score and validation score (plus the SFT run's validation scores from
``sft_metrics`` when given, drawn before step 0), KL, entropy, response length and seconds per
step. A panel whose keys the run never logged says so instead of a curve. Returns the PNG path.
matplotlib is an optional extra (``pip install 'hybridrl[plot]'``); without it ``plot_run``
raises ``ImportError`` naming the pip install. A missing or empty metrics file raises
``ValueError`` naming the path. ``add_parser`` registers ``hybridrl plot`` (hybridrl.cli);
``main(argv)`` is the same as ``python -m hybridrl.plot RUN_DIR`` (one error line, status 2).
Without RUN_DIR the command plots the default run folder (``outputs/default``: the defaults of
``trainer.output_dir`` and ``trainer.experiment_name``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (panel title, [(metric key, label)])
PANELS = (
    ("score", [("critic/score/mean", "train score"), ("val/score/mean", "val score (greedy)")]),
    ("KL", [("actor/kl_loss", "kl_loss (to ref)"), ("actor/ppo_kl", "ppo_kl"),
            ("actor/reward_kl_penalty", "in-reward kl")]),
    ("entropy", [("actor/entropy", "entropy")]),
    ("response length", [("response_length/mean", "mean tokens")]),
    ("seconds per step", [("timing_s/step", "step"), ("timing_s/gen", "gen"),
                          ("timing_s/reshard", "reshard")]),
)


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no metrics file {str(path)!r} (a run with the jsonl logger writes it)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"metrics file {str(path)!r} is empty")
    return rows


def _series(rows: list[dict], key: str, kept=None):
    pts = [(r["step"], r[key]) for r in rows if key in r and (kept is None or
                                                               r.get("kept", True) == kept)]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: str | Path, out: str | Path | None = None,
             sft_metrics: str | Path | None = None) -> str:
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("hybridrl plot needs matplotlib: pip install matplotlib "
                          "(or pip install 'hybridrl[plot]')") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    sft = read_metrics(sft_metrics) if sft_metrics and Path(sft_metrics).is_file() else []
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (title, keys) in zip(axes, PANELS):
        drawn = False
        for key, label in keys:
            xs, ys = _series(rows, key, kept=True)
            if xs:
                ax.plot(xs, ys, marker="o" if key.startswith("val") else None, ms=3, label=label)
                drawn = True
            bx, by = _series(rows, key, kept=False)
            if bx:
                ax.plot(bx, by, "x", color="red", label=f"{label} (rolled back)")
        if title == "score" and sft:
            xs, ys = _series(sft, "val/score/mean")
            if xs:
                last = xs[-1]
                ax.plot([x - last for x in xs], ys, "s--", ms=3, label="SFT val (steps before 0)")
                drawn = True
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(out) if out else run_dir / "plot.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return str(out)


def _arguments(parser) -> None:
    from hybridrl.config.trainer import TrainerConfig

    parser.add_argument("run_dir", nargs="?", default=TrainerConfig().run_dir,
                        help="run folder holding metrics.jsonl: <trainer.output_dir>/"
                             "<trainer.experiment_name> (default: %(default)s)")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/plot.png)")
    parser.add_argument("--sft", default=None, help="an SFT run's metrics.jsonl to draw too")


def _cmd_plot(args) -> int:
    try:
        print(plot_run(args.run_dir, args.out, args.sft))
    except ImportError as err:  # the optional extra: reported like bad input, one line
        raise ValueError(str(err)) from None
    return 0


def add_parser(sub) -> None:
    """Register ``hybridrl plot`` on the ``hybridrl`` command's subparsers."""
    cmd = sub.add_parser("plot", help="a PNG of a run's curves from its run folder's "
                                      "metrics.jsonl")
    _arguments(cmd)
    cmd.set_defaults(func=_cmd_plot)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hybridrl plot", description=__doc__.split("\n")[0])
    _arguments(parser)
    try:
        return _cmd_plot(parser.parse_args(argv))
    except ValueError as err:
        print(f"hybridrl plot: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
