"""``make bench``: run the benchmark suite, print every table, record the figures in docs/.

    .venv/bin/python benchmarks/run_all.py [--only NAME ...] [--quick] [--no-write]
        [--doc docs/benchmarks.md]

Each entry of ``suite(quick)`` is one benchmark script run as its own process with the same
Python (``sys.executable``); its output (which already holds both sides and their ratio from the
same run) is printed as it comes. The load average is read before and after each one, since the
machine may be shared. Unless ``--no-write``, the section between the markers
``<!-- make bench: begin -->`` and ``<!-- make bench: end -->`` of ``--doc`` is replaced by: the
date, the machine (CPU model, cores, memory, Python, torch, GPU if any), and per benchmark its
command, wall seconds, load averages and output; the rest of the page (the curated figures and
their discussion) is left as it is. A benchmark that fails is recorded with its exit status and
the last lines of its output; the runner then exits 1 after writing. ``trl_compare`` runs only
when TRL is installed (it says how to install it otherwise).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- make bench: begin -->", "<!-- make bench: end -->"


def suite(quick: bool) -> list[tuple[str, list[str]]]:
    """(name, arguments after the script path); ``quick`` trims sizes and repeats."""
    return [
        ("kernels", ["-m", "benchmarks.kernels", "--sizes",
                     "256x512,1024x1024" if quick else "256x512,1024x1024,1024x4096"]),
        ("rollout_engine", ["benchmarks/rollout_engine.py", "--rounds", "3" if quick else "5"]),
        ("rollout_engine_small", ["benchmarks/rollout_engine.py", "--size", "small",
                                  "--rounds", "2" if quick else "3"]),
        ("reshard", ["benchmarks/reshard.py", "--layouts", "2,2,2,1", "4,2,2,1",
                     "--repeats", "3" if quick else "5"] + (["--no-megatron"] if quick else [])),
        ("rollout_bytes", ["benchmarks/rollout_bytes.py"] + (["--worlds", "2", "4"] if quick
                                                            else [])),
        ("throughput", ["benchmarks/throughput.py", "--steps", "4" if quick else "10"]),
        ("packing", ["benchmarks/packing.py", "--rounds", "1" if quick else "3"]
         + (["--seqs", "32"] if quick else [])),
        ("plan_time", ["benchmarks/plan_time.py", "--steps", "4" if quick else "6"]
         + (["--only", "demo_1rank", "demo_2ranks", "tp2", "pp2", "split_async"] if quick
            else [])),
        ("trl_compare", ["benchmarks/trl_compare.py"] + (["--steps", "2", "--rounds", "1"] if quick
                                                           else [])),
    ]


def machine() -> str:
    """One paragraph describing where the figures come from."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} logical cores{mem}, {gpu}; {platform.system()} "
            f"{platform.release()}; Python {platform.python_version()}, torch {torch.__version__}")


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def run_one(name: str, args: list[str]) -> dict:
    """Run one benchmark, echoing its output; its record for the doc."""
    cmd = [sys.executable, *args]
    shown = " ".join([".venv/bin/python", *args])
    print(f"\n=== {name}: {shown} (load {_load()})", flush=True)
    before, t0 = _load(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    rc = proc.wait()
    return {"name": name, "cmd": shown, "rc": rc, "wall": time.perf_counter() - t0,
            "load": (before, _load()), "out": [ln for ln in lines if "Warning" not in ln
                                               and not ln.strip().startswith("return func")]}


def render(records: list[dict], command: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [BEGIN, "", f"## Latest `make bench` run ({now})", "",
           f"Command: `{command}`. Machine: {machine()}. Load average (1/5/15 min) before and "
           "after each benchmark is given with it: on a shared machine, compare the two sides "
           "of one table, not figures of different runs.", ""]
    for r in records:
        status = "ok" if r["rc"] == 0 else f"FAILED (exit {r['rc']})"
        out += [f"### {r['name']}", "",
                f"`{r['cmd']}`: {status}, {r['wall']:.0f} s, load {r['load'][0]} -> "
                f"{r['load'][1]}", "", "```"]
        body = r["out"] if r["rc"] == 0 else r["out"][-20:]
        out += body or ["(no output)"]
        out += ["```", ""]
    out.append(END)
    return "\n".join(out)


def write_doc(doc: Path, section: str) -> None:
    """Replace the marked section of ``doc`` (appended at the end when there is none)."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    doc.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", help="names of the benchmarks to run (default: all)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args(argv)
    entries = suite(args.quick)
    known = [n for n, _ in entries]
    if args.only and (bad := sorted(set(args.only) - set(known))):
        ap.error(f"--only: unknown {bad}; choose from {known}")
    print(f"machine: {machine()}")
    records = [run_one(n, a) for n, a in entries if not args.only or n in args.only]
    if not args.no_write:
        command = "make bench" + (" BENCH_ARGS='" + " ".join(argv or sys.argv[1:]) + "'"
                                  if (argv or sys.argv[1:]) else "")
        write_doc(Path(args.doc), render(records, command))
        print(f"\nwrote the figures into {args.doc}")
    failed = [r["name"] for r in records if r["rc"] != 0]
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
