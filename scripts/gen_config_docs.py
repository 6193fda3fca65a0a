"""Regenerate docs/config.md from the config dataclasses (hybridrl/config/).

Usage (from the repository root):
    .venv/bin/python scripts/gen_config_docs.py           # write docs/config.md
    .venv/bin/python scripts/gen_config_docs.py --check   # exit 1 if docs/config.md is stale

Contract: the file written is exactly ``hybridrl.config.reference.render_config_reference()``;
tests/unit/test_config_docs.py fails when the committed file differs from it.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hybridrl.config.reference import DOC_PATH, REGEN_COMMAND, render_config_reference  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the file is current")
    args = parser.parse_args(argv)
    path = os.path.join(ROOT, DOC_PATH)
    text = render_config_reference()
    if args.check:
        current = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        if current != text:
            print(f"{DOC_PATH} is out of date; run: {REGEN_COMMAND}", file=sys.stderr)
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
