"""Runs inside the code sandbox for function-style tests: the candidate, then the test calls.

Contract: ``python -I -S sandbox_harness.py`` in ``/work`` holding ``solution.py`` (the
candidate program) and ``calls.json`` (``{"setup": "<python>", "calls": ["<expression>", ...]}``:
inputs only, never the expected values). It runs the program (``__name__ == "__main__"``), then
``setup``, then evaluates each call in the program's namespace and writes one JSON line per call
to fd 3: ``{"i": k, "repr": repr(value)}`` or ``{"i": k, "error": "<Type>: <message>"}``. The
trusted side reads those lines and compares the values with the expected ones; whatever the
candidate does to this process (exit early, forge lines) it never sees what is expected.
Stdlib only: it runs in a bare interpreter.
"""

import json
import os


def main() -> None:
    with open("calls.json", encoding="utf-8") as f:
        spec = json.load(f)
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(source, "solution.py", "exec"), namespace)
    if spec.get("setup"):
        exec(compile(spec["setup"], "tests", "exec"), namespace)
    for i, expr in enumerate(spec["calls"]):
        try:
            line = {"i": i, "repr": repr(eval(compile(expr, f"case {i}", "eval"), namespace))}
        except Exception as err:  # noqa: BLE001 - the candidate's failure on this case
            line = {"i": i, "error": f"{type(err).__name__}: {err}"[:200]}
        os.write(3, (json.dumps(line) + "\n").encode())


if __name__ == "__main__":
    main()
